#!/usr/bin/env bash
# Runs the README's "Run your own gateway and node" shell block and its "Use it from any OpenAI
# client" Python example exactly as written, from the repository root as the README says (the
# API key the block printed goes in place of the example's placeholder). Every process the block
# starts is stopped at the end and the files it writes (gateway.toml, spine-data/, node.key,
# *.log: all in .gitignore) are removed. Needs scripts/setup.sh to have run and the ports the
# README names free (8080, 8082, 8400, 8401, 19000).
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
spine_init readme
cd "$ROOT"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/spine-readme.XXXXXX")"
FILES=(gateway.toml spine-data node.key llama.log gateway.log agent.log)
for f in "${FILES[@]}"; do
  if [[ -e "$f" ]]; then echo "[readme] $f exists here already; not overwriting it" >&2; exit 1; fi
done

"$SPINE_PYTHON" - README.md "$WORK" <<'PY'
import sys, pathlib
readme, work = pathlib.Path(sys.argv[1]).read_text(), pathlib.Path(sys.argv[2])
def block(heading, lang):
    section = readme[readme.index(heading):]
    start = section.index("```" + lang + "\n") + len(lang) + 4
    return section[start:section.index("```\n", start)]
(work / "quickstart.sh").write_text(block("## Run your own gateway and node", "sh"))
def blocks(heading, lang):
    section = readme[readme.index(heading) + len(heading):]
    section = section[:section.find("\n## ")] if "\n## " in section else section
    out, rest = [], section
    while "```" + lang + "\n" in rest:
        start = rest.index("```" + lang + "\n") + len(lang) + 4
        end = rest.index("```\n", start)
        out.append(rest[start:end])
        rest = rest[end + 4:]
    return "\n".join(out)
# every Python block of the section, in order (the later ones use the first one's client)
(work / "client.py").write_text(blocks("## Use it from any OpenAI client", "python"))
PY

cleanup() {
  # the block's servers share its process group
  if [[ -n "${PGID:-}" ]]; then kill -- "-$PGID" 2>/dev/null || true; fi
  sleep 1
  rm -rf "${FILES[@]}" "$WORK"
}
trap cleanup EXIT

echo "[readme] running the README's shell block as written" >&2
setsid bash -e "$WORK/quickstart.sh" > "$WORK/out.txt" 2>&1 &
PGID=$!
# the block ends once its node is routable; its servers stay up, in its process group
for _ in $(seq 1 2400); do
  grep -q 'API key: sk-spine-' "$WORK/out.txt" && break
  kill -0 "$PGID" 2>/dev/null || break
  sleep 0.5
done
if ! grep -q 'API key: sk-spine-' "$WORK/out.txt"; then
  echo "[readme] the block failed:" >&2
  tail -40 "$WORK/out.txt" >&2
  for f in gateway.log agent.log llama.log; do [[ -f $f ]] && { echo "--- $f" >&2; tail -20 "$f" >&2; }; done
  exit 1
fi
API_KEY="$(grep -o 'API key: sk-spine-[A-Za-z0-9_-]*' "$WORK/out.txt" | head -1 | cut -d' ' -f3)"

echo "[readme] running the README's Python example as written (the API key put in)" >&2
sed "s/sk-spine-…/$API_KEY/" "$WORK/client.py" > "$WORK/client_keyed.py"
OUT="$(timeout 300 "$SPINE_PYTHON" "$WORK/client_keyed.py")"
echo "$OUT" | tail -3 >&2
echo "$OUT" | grep -q 'completion_tokens=' || { echo "[readme] no usage from the example" >&2; exit 1; }
echo "$OUT" | grep -q 'output_tokens=' || { echo "[readme] no usage from the Responses example" >&2; exit 1; }
echo "[readme] ok" >&2
