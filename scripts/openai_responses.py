"""The Responses API through a spine gateway with the official OpenAI Python SDK, unmodified.

Usage: python openai_responses.py <base_url> <api_key> [<api_key_without_credit>]

Sends `responses.create` (non-streamed and streamed), the `responses.stream()` helper (which
checks the event sequence as it accumulates it) and one request the gateway refuses, then
prints one JSON object (the tests read it).
"""
import json
import sys

import openai
from openai import OpenAI


def main() -> int:
    base_url, api_key = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    common = dict(
        model="smollm2",
        instructions="Answer in one short sentence.",
        input="Name three colors.",
        max_output_tokens=32,
        temperature=0,
    )

    raw = client.responses.with_raw_response.create(**common)
    full = raw.parse()
    nonstream = {
        "request_id": raw.headers.get("x-request-id"),
        "id": full.id,
        "object": full.object,
        "status": full.status,
        "text": full.output_text,
        "usage": full.usage.model_dump() if full.usage else None,
    }

    raw = client.responses.with_raw_response.create(stream=True, **common)
    stream_request_id = raw.headers.get("x-request-id")
    deltas, types, completed = [], [], None
    for event in raw.parse():
        types.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type in ("response.completed", "response.incomplete"):
            completed = event.response
    streamed = {
        "request_id": stream_request_id,
        "deltas": "".join(deltas),
        "types": types,
        "status": completed.status if completed else None,
        "text": completed.output_text if completed else None,
        "usage": completed.usage.model_dump() if completed and completed.usage else None,
    }

    # the SDK's own accumulator: raises on an event sequence it cannot follow
    with client.responses.stream(**common) as stream:
        helper_deltas = "".join(
            e.delta for e in stream if e.type == "response.output_text.delta"
        )
        final = stream.get_final_response()
    helper = {"deltas": helper_deltas, "text": final.output_text, "status": final.status,
              "usage": final.usage.model_dump() if final.usage else None}

    try:
        client.responses.create(previous_response_id="resp_x", **common)
        refused = None
    except openai.BadRequestError as e:
        refused = {"status": e.status_code, "code": e.code, "param": e.param}

    # the error codes a client branches on, as the SDK raises them
    errors = {}
    try:
        client.responses.create(model="smollm2", input="word " * 12000, max_output_tokens=8)
    except openai.BadRequestError as e:
        errors["over_context"] = {"class": type(e).__name__, "status": e.status_code, "code": e.code, "param": e.param}
    if len(sys.argv) > 3:
        poor = OpenAI(base_url=base_url, api_key=sys.argv[3], max_retries=0, timeout=120)
        try:
            poor.responses.create(**common)
        except openai.APIStatusError as e:
            errors["no_credit"] = {"class": type(e).__name__, "status": e.status_code, "code": e.code}

    print(json.dumps({"nonstream": nonstream, "stream": streamed, "helper": helper, "refused": refused, "errors": errors}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
