//! The router's body classifier for OpenAI responses (design brief §3, §5): the router does not
//! parse SSE itself; it asks this one whether a 2xx body has started.

use serde_json::Value;
use spine_core::{BodyClassifier, BodySignal, ClassifyBody, FirstBytes};

use crate::sse::{SseEvent, SseParser};

/// [`ClassifyBody`] for OpenAI-compatible engines: an SSE body (`text/event-stream`) gets an
/// [`SseClassifier`], any other body [`FirstBytes`] (a non-streamed answer is committed at its
/// first byte; the metering layer checks the whole body).
#[derive(Clone, Copy, Debug, Default)]
pub struct SseClassify;

impl ClassifyBody for SseClassify {
    fn classifier(&self, content_type: Option<&str>) -> Box<dyn BodyClassifier> {
        self.classifier_for(content_type, spine_core::MAX_N)
    }

    fn classifier_for(&self, content_type: Option<&str>, choices: u32) -> Box<dyn BodyClassifier> {
        let sse = content_type.is_some_and(|v| spine_core::is_event_stream(v.as_bytes()));
        if sse {
            Box::new(SseClassifier {
                choices: u64::from(choices.max(1)),
                ..SseClassifier::default()
            })
        } else {
            Box::new(FirstBytes::default())
        }
    }
}

/// Classifies a chat or text completion SSE stream, event by event:
///
/// - content: a chunk with a choice whose `delta.content`, `delta.reasoning_content` or `text` is
///   a non-empty string, whose `delta.tool_calls` is a non-empty array, or whose `finish_reason`
///   is set (an answer that is empty by the model's choice is still an answer);
/// - failed: an event whose JSON has a non-null top-level `error`, `[DONE]` before any content,
///   an SSE parse error, or (at [`BodyClassifier::finish`]) a stream that ended with no content;
/// - anything else (role-only deltas, usage chunks, data that is not JSON) is pending.
///
/// After content, only a later error event changes the answer (to failed).
#[derive(Debug)]
pub struct SseClassifier {
    parser: SseParser,
    events: Vec<SseEvent>,
    content: bool,
    failed: bool,
    /// Choices the caller asked for: content of choice `choices` or later is not its answer
    /// (a node's "first token" for a choice the meter drops, sent to look prompt while it
    /// queued the request, was taken as the answer's start).
    choices: u64,
}

impl Default for SseClassifier {
    /// For a request of at most [`MAX_N`](spine_core::MAX_N) choices.
    fn default() -> Self {
        Self {
            parser: SseParser::default(),
            events: Vec::new(),
            content: false,
            failed: false,
            choices: u64::from(spine_core::MAX_N),
        }
    }
}

impl SseClassifier {
    fn signal(&self) -> BodySignal {
        if self.failed {
            BodySignal::Failed
        } else if self.content {
            BodySignal::Content
        } else {
            BodySignal::Pending
        }
    }

    fn judge_events(&mut self) {
        for event in std::mem::take(&mut self.events) {
            let data = event.data().trim();
            if data == "[DONE]" {
                if !self.content {
                    self.failed = true;
                }
                continue;
            }
            // cheap pre-check: most chunks after the first token are plain deltas
            if self.content && !data.contains("\"error\"") {
                continue;
            }
            let Ok(value) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            if value.get("error").is_some_and(|e| !e.is_null()) {
                self.failed = true;
                continue;
            }
            if !self.content && has_content(&value, self.choices) {
                self.content = true;
            }
        }
    }
}

fn non_empty_str(v: Option<&Value>) -> bool {
    v.and_then(Value::as_str).is_some_and(|s| !s.is_empty())
}

fn has_content(chunk: &Value, asked: u64) -> bool {
    let Some(choices) = chunk.get("choices").and_then(Value::as_array) else {
        return false;
    };
    choices.iter().enumerate().any(|(position, choice)| {
        let index = match choice.get("index") {
            None | Some(Value::Null) => position as u64,
            Some(i) => i.as_u64().unwrap_or(u64::MAX),
        };
        if index >= asked {
            return false;
        }
        let delta = choice.get("delta");
        non_empty_str(choice.get("text"))
            || choice.get("finish_reason").is_some_and(|f| !f.is_null())
            || delta.is_some_and(|d| {
                non_empty_str(d.get("content"))
                    || non_empty_str(d.get("reasoning_content"))
                    || non_empty_str(d.get("reasoning"))
                    || d.get("tool_calls")
                        .and_then(Value::as_array)
                        .is_some_and(|t| !t.is_empty())
            })
    })
}

impl BodyClassifier for SseClassifier {
    fn feed(&mut self, chunk: &[u8]) -> BodySignal {
        if self.failed {
            return BodySignal::Failed;
        }
        if self.parser.feed(chunk, &mut self.events).is_err() {
            self.failed = true;
            return BodySignal::Failed;
        }
        self.judge_events();
        self.signal()
    }

    fn finish(&mut self) -> BodySignal {
        if !self.failed {
            if self.parser.finish(&mut self.events).is_err() {
                self.failed = true;
            } else {
                self.judge_events();
            }
        }
        if !self.content {
            self.failed = true;
        }
        self.signal()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(chunks: &[&str]) -> (Vec<BodySignal>, BodySignal) {
        let mut c = SseClassify.classifier(Some("text/event-stream; charset=utf-8"));
        let signals = chunks.iter().map(|ch| c.feed(ch.as_bytes())).collect();
        (signals, c.finish())
    }

    /// Content of a choice the caller did not ask for (the meter drops it) is not the answer's
    /// first content: a node sent one for choice 7 of an `n` = 1 request to look prompt while
    /// it queued the request, and dodged the first-content deadline.
    #[test]
    fn content_of_a_choice_not_asked_for_is_not_first_content() {
        use BodySignal::{Content, Pending};
        let chunk = |index: u64| {
            format!("data: {{\"choices\":[{{\"index\":{index},\"delta\":{{\"content\":\"zz\"}}}}]}}\n\n")
        };
        let mut c = SseClassify.classifier_for(Some("text/event-stream"), 1);
        assert_eq!(c.feed(chunk(7).as_bytes()), Pending);
        assert_eq!(c.feed(chunk(1).as_bytes()), Pending);
        assert_eq!(c.feed(chunk(0).as_bytes()), Content);
        let mut c = SseClassify.classifier_for(Some("text/event-stream"), 2);
        assert_eq!(c.feed(chunk(1).as_bytes()), Content);
    }

    #[test]
    fn role_chunk_is_pending_first_token_commits() {
        use BodySignal::{Content, Pending};
        let role = "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":null}}]}\n\n";
        let tok = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n";
        // split inside the token event: still pending until the blank line
        let (signals, end) = run(&[role, &tok[..20], &tok[20..], "data: [DONE]\n\n"]);
        assert_eq!(signals, vec![Pending, Pending, Content, Content]);
        assert_eq!(end, Content);
    }

    #[test]
    fn failures_before_content() {
        use BodySignal::{Failed, Pending};
        let err = "data: {\"error\":{\"message\":\"boom\",\"type\":\"server_error\"}}\n\n";
        assert_eq!(run(&[err]), (vec![Failed], Failed));
        assert_eq!(run(&["data: [DONE]\n\n"]), (vec![Failed], Failed));
        assert_eq!(run(&[": keepalive\n\n"]), (vec![Pending], Failed));
        assert_eq!(run(&[]), (vec![], Failed));
        let usage = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3}}\n\n";
        assert_eq!(run(&[usage]), (vec![Pending], Failed));
    }

    #[test]
    fn error_after_content_is_remembered() {
        use BodySignal::{Content, Failed};
        let tok = "data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n";
        let err = "data: {\"error\":{\"message\":\"lost\"}}\n\n";
        assert_eq!(
            run(&[tok, err, tok]),
            (vec![Content, Failed, Failed], Failed)
        );
        let stop =
            "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n";
        assert_eq!(run(&[stop]), (vec![Content], Content));
    }

    proptest::proptest! {
        /// Any bytes, split anywhere: no panic, and once failed always failed.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512), cut in 0usize..512) {
            let mut c = SseClassify.classifier(Some("text/event-stream"));
            let cut = cut.min(bytes.len());
            let first = c.feed(&bytes[..cut]);
            let second = c.feed(&bytes[cut..]);
            let end = c.finish();
            if first == BodySignal::Failed {
                proptest::prop_assert_eq!(second, BodySignal::Failed);
            }
            if second == BodySignal::Failed {
                proptest::prop_assert_eq!(end, BodySignal::Failed);
            }
        }
    }

    #[test]
    fn non_sse_bodies_commit_on_first_byte() {
        let mut c = SseClassify.classifier(Some("application/json"));
        assert_eq!(c.feed(b"{\"id\""), BodySignal::Content);
        let mut empty = SseClassify.classifier(None);
        assert_eq!(empty.finish(), BodySignal::Failed);
    }
}
