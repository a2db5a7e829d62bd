"""Talk to a spine gateway with the official OpenAI Python SDK, unmodified.

Usage: python openai_chat.py <base_url> <api_key> [--json] [prompt]

Sends a streamed chat completion that asks for usage and prints the reply, the usage and the
request id. With --json it also sends a non-streamed one and prints one JSON object (the tests).
"""
import json
import sys

import openai
from openai import OpenAI


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--json"]
    as_json = "--json" in sys.argv
    base_url, api_key = args[0], args[1]
    prompt = args[2] if len(args) > 2 else "Name three colors."
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": prompt}]

    # The tests (--json) also check the non-streamed path; the demo sends one streamed request.
    full = None
    if as_json:
        full = client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=48, temperature=0
        )
    else:
        print("[streamed reply] ", end="", flush=True)
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2",
        messages=messages,
        max_tokens=48,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    stream_request_id = raw.headers.get("x-request-id")
    stream = raw.parse()
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                parts.append(choice.delta.content)
                if not as_json:
                    print(choice.delta.content, end="", flush=True)
            if choice.finish_reason:
                finish = choice.finish_reason
    streamed_text = "".join(parts)

    if as_json:
        # models.retrieve: the served model, and OpenAI's NotFoundError for one that is not
        model = client.models.retrieve("smollm2")
        try:
            client.models.retrieve("no-such-model")
            missing = None
        except openai.NotFoundError as e:
            missing = {"status": e.status_code, "code": e.code, "param": e.param}
        print(json.dumps({
            "retrieved_model": {"id": model.id, "object": model.object},
            "missing_model": missing,
            "nonstream_text": full.choices[0].message.content,
            "nonstream_finish_reason": full.choices[0].finish_reason,
            "nonstream_usage": full.usage.model_dump() if full.usage else None,
            "stream_text": streamed_text,
            "stream_finish_reason": finish,
            "stream_usage": usage.model_dump() if usage else None,
            "stream_request_id": stream_request_id,
        }))
    else:
        print()
        print(f"[streamed usage] {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens" if usage else "[streamed] no usage chunk")
        print(f"[streamed request id] {stream_request_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
