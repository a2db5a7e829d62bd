// Talk to a spine gateway with the official OpenAI Node SDK, unmodified (issue 16).
//
// Usage: node openai_node.cjs <base_url> <api_key> [<api_key_without_credit>]
// Needs SPINE_NODE_SDK: a node_modules directory holding the `openai` package (scripts/setup.sh
// installs it into ~/.cache/spine/node-sdk/node_modules). Prints one JSON object: a non-streamed
// and a streamed chat (with usage), models.retrieve, and the SDK error class of each refusal.
const path = require("path");
const sdk = require(path.join(process.env.SPINE_NODE_SDK || "", "openai"));
const { OpenAI } = sdk;

async function refusal(fn) {
  try {
    await fn();
    return null;
  } catch (e) {
    return { class: e.constructor.name, status: e.status, code: e.code ?? null, param: e.param ?? null };
  }
}

async function main() {
  const [baseURL, apiKey, poorKey] = process.argv.slice(2);
  const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 120000 });
  const messages = [{ role: "user", content: "Name three colors." }];
  const full = await client.chat.completions.create({
    model: "smollm2", messages, max_tokens: 32, temperature: 0,
  });
  const stream = await client.chat.completions.create({
    model: "smollm2", messages, max_tokens: 32, temperature: 0,
    stream: true, stream_options: { include_usage: true },
  });
  let text = "", usage = null, finish = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      if (c.delta && c.delta.content) text += c.delta.content;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  // the Responses API, non-streamed and streamed
  const rargs = { model: "smollm2", input: "Name three colors.", max_output_tokens: 32, temperature: 0 };
  const resp = await client.responses.create(rargs);
  const rstream = await client.responses.create({ ...rargs, stream: true });
  let rtext = "", rfinal = null;
  for await (const ev of rstream) {
    if (ev.type === "response.output_text.delta") rtext += ev.delta;
    if (ev.type === "response.completed" || ev.type === "response.incomplete") rfinal = ev.response;
  }
  const finalText = (r) => (r ? r.output : [])
    .filter((o) => o.type === "message")
    .flatMap((o) => o.content)
    .filter((c) => c.type === "output_text")
    .map((c) => c.text)
    .join("");
  const model = await client.models.retrieve("smollm2");
  const bad = new OpenAI({ baseURL, apiKey: "sk-spine-not-a-key", maxRetries: 0 });
  const out = {
    nonstream_text: full.choices[0].message.content,
    nonstream_usage: full.usage,
    stream_text: text,
    stream_finish_reason: finish,
    stream_usage: usage,
    retrieved_model: { id: model.id, object: model.object },
    responses: {
      nonstream_text: resp.output_text,
      nonstream_usage: resp.usage,
      stream_text: rtext,
      stream_final_text: finalText(rfinal),
      stream_usage: rfinal ? rfinal.usage : null,
    },
    errors: {
      missing_model: await refusal(() => client.models.retrieve("no-such-model")),
      unknown_model_chat: await refusal(() => client.chat.completions.create({ model: "no-such-model", messages })),
      bad_key: await refusal(() => bad.chat.completions.create({ model: "smollm2", messages })),
      bad_request: await refusal(() => client.chat.completions.create({ model: "smollm2", messages, max_tokens: 0 })),
      over_context: await refusal(() => client.responses.create({ model: "smollm2", input: "word ".repeat(12000), max_output_tokens: 8 })),
      no_credit: poorKey
        ? await refusal(() => new OpenAI({ baseURL, apiKey: poorKey, maxRetries: 0 }).chat.completions.create({ model: "smollm2", messages, max_tokens: 8 }))
        : null,
    },
  };
  console.log(JSON.stringify(out));
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
