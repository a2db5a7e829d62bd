#!/usr/bin/env python3
"""Sends each streamed chat request of a JSON list through the official OpenAI Python SDK and
prints, per request, what the SDK made of the gateway's stream: the text, finish reason, usage,
an APIError the SDK raised (an error event, as designed), or any other exception (the SDK could
not parse what the gateway sent: a defect).

    sdk_stream_check.py BASE_URL API_KEY REQUESTS.json   # prints a JSON list, one entry per request
    sdk_stream_check.py BASE_URL API_KEY REQUESTS.json --responses

With --responses each chat request is sent as the Responses API request it stands for
(`messages` as `input`, `max_tokens` as `max_output_tokens`, `temperature`) through the SDK's
`responses.stream()` helper, whose accumulator checks the event sequence: `text` is the
`response.output_text.delta` text, `error` the `error` / `response.failed` message.
"""
import json
import sys

import openai
from openai import OpenAI


def responses_request(req: dict) -> dict:
    out = {"model": req["model"], "input": req["messages"]}
    if "max_tokens" in req:
        out["max_output_tokens"] = req["max_tokens"]
    if "temperature" in req:
        out["temperature"] = req["temperature"]
    return out


def check_responses(client: OpenAI, req: dict, r: dict) -> None:
    # the helper's accumulator raises on an event sequence it cannot follow (a crash here)
    with client.responses.stream(**responses_request(req)) as stream:
        r["request_id"] = stream._response.headers.get("x-request-id")  # noqa: SLF001
        for event in stream:
            r["chunks"] += 1
            if event.type == "response.output_text.delta":
                r["text"] += event.delta
            elif event.type == "error":
                r["error"] = event.message
            elif event.type == "response.failed":
                r["error"] = r["error"] or event.response.error.message
            elif event.type in ("response.completed", "response.incomplete"):
                r["finish"] = event.response.status
                if event.response.usage is not None:
                    r["usage"] = event.response.usage.model_dump()


def main() -> None:
    base_url, api_key, path = sys.argv[1:4]
    responses = "--responses" in sys.argv[4:]
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    with open(path, encoding="utf-8") as f:
        requests = json.load(f)
    results = []
    for req in requests:
        r = {"request_id": None, "text": "", "finish": None, "usage": None, "error": None,
             "crash": None, "chunks": 0}
        try:
            if responses:
                check_responses(client, req, r)
                results.append(r)
                continue
            raw = client.chat.completions.with_raw_response.create(**req)
            r["request_id"] = raw.headers.get("x-request-id")
            for chunk in raw.parse():
                r["chunks"] += 1
                if chunk.usage is not None:
                    r["usage"] = chunk.usage.model_dump()
                for choice in chunk.choices:
                    if choice.delta is not None and choice.delta.content:
                        r["text"] += choice.delta.content
                    if choice.finish_reason:
                        r["finish"] = choice.finish_reason
        except openai.APIError as e:  # an error event or status, in OpenAI's shape
            r["error"] = getattr(e, "message", None) or str(e)
        except Exception as e:  # noqa: BLE001 - anything else is the SDK failing on our bytes
            r["crash"] = f"{type(e).__name__}: {e}"
        results.append(r)
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
