#!/usr/bin/env python3
"""How many more tokens an honest llama-server generates than the canonical count of the text it
delivered, per kind of sampling constraint (docs/metering.md, "Constrained sampling").

Usage: start a llama-server (e.g. `$SPINE_LLAMA_SERVER -m $SPINE_MODEL_GGUF --port 18555 -t 1`),
then `python3 scripts/measure-constrained.py http://127.0.0.1:18555 [mode ...]`. Prints, per mode,
the engine's `completion_tokens` minus `/tokenize`'s count of the delivered text for 20 requests.
Modes: none, json_object, json_schema, grammar (text-level constraints) and logit_bias_up,
logit_bias_ban, logit_bias_one_char (token-level: a bias on common tokens, or a strong one
on a one-letter token); all of them when none is named.
"""
import json
import sys
import urllib.request

BASE = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:18555"
ONLY = set(sys.argv[2:])


def post(path, body):
    req = urllib.request.Request(BASE + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=300))


PROMPTS = ["Describe a cat as JSON with name, age and color.",
           "List three fruits with their colors as JSON.",
           "Give a JSON object describing the weather in Paris.",
           "Write a JSON object for a book: title, author, year.",
           "Return a JSON array of five prime numbers.",
           "Give me a person record in JSON: first name, last name, city, hobbies.",
           "Summarize the plot of Hamlet as JSON with keys act and summary.",
           "JSON describing a car: make, model, year, features.",
           "Describe the planets of the solar system as JSON.",
           "Give a recipe for pancakes in JSON with ingredients and steps."]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "items": {"type": "array", "items": {"type": "string"}},
                                           "count": {"type": "integer"}},
          "required": ["name", "items", "count"]}
MODES = {
    "none": {},
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "x", "schema": SCHEMA}}},
    "grammar": {"grammar": 'root ::= [A-Za-z ,.]+ "."'},
}


def token_ids(texts):
    """The vocabulary id of each text that is one token."""
    ids = []
    for t in texts:
        toks = post("/tokenize", {"content": t})["tokens"]
        if len(toks) == 1:
            ids.append(toks[0])
    return ids


# token-level constraints: a caller's logit_bias on common words (pushing them in, or banning
# them so that the words are spelled from smaller pieces)
COMMON = [" the", " a", " and", " of", " to", " is", " in", " with", " for", " that", " it",
          " as", " on", " are", " The", " name", " color", " JSON", "\n", ":", ",", "."]
MODES["logit_bias_up"] = {"logit_bias": {str(i): 4 for i in token_ids([" the", " and", ","])}}
MODES["logit_bias_ban"] = {"logit_bias": {str(i): -100 for i in token_ids(COMMON)}}
# one strong bias on a one-letter token: the engine emits that token over and over, a text whose
# canonical tokenization merges the letters
MODES["logit_bias_one_char"] = {"logit_bias": {str(i): 100 for i in token_ids(["e"])}}

for mode, extra in MODES.items():
    if ONLY and mode not in ONLY:
        continue
    rows = []
    for i, prompt in enumerate(PROMPTS):
        for temperature in (0.0, 0.8):
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 400,
                    "temperature": temperature, "seed": i, **extra}
            answer = post("/v1/chat/completions", body)
            text = answer["choices"][0]["message"].get("content") or ""
            claimed = answer["usage"]["completion_tokens"]
            canonical = len(post("/tokenize", {"content": text})["tokens"])
            rows.append((claimed - canonical, canonical))
    print(mode, "(excess, canonical):", sorted(rows), flush=True)
