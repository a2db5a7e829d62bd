//! OpenAI's Responses API (`POST /v1/responses`) served over the chat completion path.
//!
//! A Responses request is translated into a chat completion request ([`chat_request`]), which
//! then takes the ordinary metered path — independent prompt count, hold, routing and retries,
//! the node's chat endpoint, egress rules, settlement, audits — and the metered answer is
//! translated back: a JSON body with [`response_from_chat`], a stream with [`ResponsesSse`]
//! (`response.output_text.delta`, …, `response.completed` with the billed usage).
//!
//! Why translate rather than forward the engines' own `/v1/responses`: every engine a node may
//! run serves chat completions, while Responses support differs by engine and version; the
//! meter, the auditor and the hostile-stream rules then have one node dialect to get right, and
//! what a caller receives on `/v1/responses` is exactly the metered chat answer re-shaped (every
//! delivered character is in a delta; `usage` is the billed count). What the translation does
//! not serve is refused up front with a 400 naming the member (`previous_response_id`:
//! nothing is stored; built-in tools; image and file inputs).

mod answer;
mod request;
mod response;

pub use answer::{
    responses_param, translate_body, translate_request, ReshapeError, ResponsesAnswer,
    TranslateError,
};
pub use request::{chat_request, ChatTranslation, ResponsesError};
pub use response::{chat_json_as_stream, response_from_chat, ResponseMeta, ResponsesSse};

#[cfg(test)]
mod tests;
