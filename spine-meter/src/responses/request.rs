//! A Responses API request (`POST /v1/responses`) as the chat completion request a node serves.

use serde_json::{json, Map, Value};

/// Why a Responses request cannot be served: the caller's error (400), in OpenAI's shape
/// through [`ResponsesError::param`] and [`ResponsesError::code`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ResponsesError {
    /// The request member at fault, as OpenAI names it (`input[2].content`), when there is one.
    pub param: Option<String>,
    /// `invalid_request` (malformed) or `unsupported_parameter` (valid, not served here).
    pub code: &'static str,
    /// What is wrong, for the caller.
    pub message: String,
}

impl ResponsesError {
    fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.into()),
            code: "invalid_request",
            message: message.into(),
        }
    }

    fn unsupported(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.into()),
            code: "unsupported_parameter",
            message: message.into(),
        }
    }
}

/// A Responses request translated: the chat completion body to send, and what the response
/// echoes back.
#[derive(Clone, Debug)]
pub struct ChatTranslation {
    /// The chat completion request body (JSON), `n` 1; streamed with
    /// `stream_options.include_usage` so the billed usage comes back.
    pub chat_body: Vec<u8>,
    /// `stream`.
    pub stream: bool,
    /// The request's members echoed in the response object (`model`, `instructions`,
    /// `max_output_tokens`, `temperature`, `top_p`, `tools`, `tool_choice`,
    /// `parallel_tool_calls`, `text`, `metadata`, `user`).
    pub echo: Map<String, Value>,
}

/// Members accepted and ignored: they change nothing a node generates (`store`: nothing is
/// stored here, and `previous_response_id` is refused, so storing would be of no use).
const IGNORED: &[&str] = &[
    "store",
    "safety_identifier",
    "service_tier",
    "prompt_cache_retention",
    "stream_options",
];

/// `metadata`, `user`, `tools`, `tool_choice` and `text` within
/// [`spine_core::check_metadata`], [`spine_core::check_user`], [`spine_core::check_tools`] and
/// [`spine_core::check_output_constraint`] (any other member passes); the caller's message when
/// not.
fn key_bound(key: &str, value: &Value) -> Result<(), String> {
    match key {
        "metadata" => spine_core::check_metadata(value),
        "user" => spine_core::check_user(value),
        "tools" => spine_core::check_tools(&value.to_string()),
        "tool_choice" => spine_core::check_output_constraint("tool_choice", &value.to_string()),
        // the translated `response_format` is checked again on the chat path; the echo is not
        "text" => spine_core::check_output_constraint("text", &value.to_string()),
        _ => Ok(()),
    }
    .map_err(|e| e.to_string())
}

/// Translates a Responses API request body into a chat completion request.
///
/// Served: `model`, `input` (a string, or message items — roles `user`, `assistant`, `system`,
/// `developer` (sent as `system`) with string content or `input_text` / `output_text` /
/// `refusal` parts — and `function_call` / `function_call_output` items), `instructions` (the
/// first system message), `max_output_tokens` (`max_tokens`), `temperature`, `top_p`, `stream`,
/// function `tools`, `tool_choice`, `parallel_tool_calls`, `text.format` (`text`,
/// `json_object`, `json_schema` → `response_format`), `user`, `metadata` (echoed only).
/// Accepted and ignored: [`IGNORED`], and `background` false, `truncation` `disabled`,
/// `include` empty, `reasoning` null or without `effort` (anything else for those four is
/// refused). An input whose last item is the assistant's (a message or a `function_call`) is
/// refused: a prefill, which the engine would continue. Everything else — `previous_response_id`, `conversation`, `prompt`, built-in tools,
/// image or file inputs, unknown members — is a 400 naming the member: nothing is forwarded
/// that the meter does not count.
///
/// # Errors
/// [`ResponsesError`] for a body that is not a JSON object, a member of the wrong shape, or a
/// member that is not served.
pub fn chat_request(body: &[u8]) -> Result<ChatTranslation, ResponsesError> {
    // as on chat: engines and serde disagree on which of two same-named members wins
    if let Some(name) = duplicate_member(body) {
        return Err(ResponsesError::invalid(
            name.clone(),
            format!("duplicate member `{name}`"),
        ));
    }
    let value: Value = serde_json::from_slice(body).map_err(|e| ResponsesError {
        param: None,
        code: "invalid_request",
        message: format!("the request body is not valid JSON: {e}"),
    })?;
    let Value::Object(req) = value else {
        return Err(ResponsesError {
            param: None,
            code: "invalid_request",
            message: "the request body must be a JSON object".to_owned(),
        });
    };
    let mut chat = Map::new();
    let mut echo = Map::new();
    let mut messages: Vec<Value> = Vec::new();
    let mut stream = false;
    let model = match req.get("model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        _ => {
            return Err(ResponsesError::invalid(
                "model",
                "`model` must be a non-empty string",
            ))
        }
    };
    chat.insert("model".into(), Value::String(model.clone()));
    echo.insert("model".into(), Value::String(model));
    match req.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => {
            messages.push(json!({"role": "system", "content": s}));
            echo.insert("instructions".into(), Value::String(s.clone()));
        }
        Some(_) => {
            return Err(ResponsesError::invalid(
                "instructions",
                "`instructions` must be a string",
            ))
        }
    }
    match req.get("input") {
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => input_items(items, &mut messages)?,
        _ => {
            return Err(ResponsesError::invalid(
                "input",
                "`input` must be a string or an array of input items",
            ))
        }
    }
    if messages.is_empty() {
        return Err(ResponsesError::invalid("input", "`input` has no items"));
    }
    // an assistant item last (a message or a function call) is a prefill: the engine would
    // continue that turn, and the meter's count of the prompt would disagree with its own
    if messages.last().and_then(|m| m.get("role")) == Some(&json!("assistant")) {
        return Err(ResponsesError::invalid(
            "input",
            "the last input item must not be an assistant message or function call: \
             continuing an assistant turn (prefill) is not supported",
        ));
    }
    for (key, value) in &req {
        // echoed (three times in a stream), forwarded, never counted: bounded as on chat
        key_bound(key, value).map_err(|message| ResponsesError::invalid(key.as_str(), message))?;
        match key.as_str() {
            "model" | "input" | "instructions" => {}
            "stream" => match value {
                Value::Bool(b) => stream = *b,
                Value::Null => {}
                _ => {
                    return Err(ResponsesError::invalid(
                        "stream",
                        "`stream` must be a boolean",
                    ))
                }
            },
            "max_output_tokens" => match value {
                Value::Null => {}
                Value::Number(n) if n.as_u64().is_some_and(|n| n > 0) => {
                    chat.insert("max_tokens".into(), value.clone());
                    echo.insert(key.clone(), value.clone());
                }
                _ => {
                    return Err(ResponsesError::invalid(
                        key.as_str(),
                        "`max_output_tokens` must be a positive integer",
                    ))
                }
            },
            // passed on as they are, once their type is right
            "temperature" | "top_p" | "parallel_tool_calls" | "prompt_cache_key" | "user" => {
                let (fits, what) = match key.as_str() {
                    "temperature" | "top_p" => (value.is_number(), "a number"),
                    "parallel_tool_calls" => (value.is_boolean(), "a boolean"),
                    // `prompt_cache_key`: the chat path scopes its affinity by it, per account
                    _ => (value.is_string(), "a string"),
                };
                if !fits && !value.is_null() {
                    return Err(ResponsesError::invalid(
                        key.as_str(),
                        format!("`{key}` must be {what}"),
                    ));
                }
                if fits {
                    chat.insert(key.clone(), value.clone());
                    echo.insert(key.clone(), value.clone());
                }
            }
            "metadata" => {
                echo.insert(key.clone(), value.clone());
            }
            "tools" => match value {
                Value::Null => {}
                Value::Array(tools) => {
                    let tools = tools
                        .iter()
                        .enumerate()
                        .map(|(i, t)| function_tool(i, t))
                        .collect::<Result<Vec<_>, _>>()?;
                    if !tools.is_empty() {
                        chat.insert("tools".into(), Value::Array(tools));
                    }
                    echo.insert(key.clone(), value.clone());
                }
                _ => return Err(ResponsesError::invalid("tools", "`tools` must be an array")),
            },
            "tool_choice" => {
                if let Some(choice) = tool_choice(value)? {
                    chat.insert("tool_choice".into(), choice);
                }
                echo.insert(key.clone(), value.clone());
            }
            "text" => {
                if let Some(format) = text_format(value)? {
                    chat.insert("response_format".into(), format);
                }
                echo.insert(key.clone(), value.clone());
            }
            "background" if matches!(value, Value::Null | Value::Bool(false)) => {}
            "truncation" if matches!(value, Value::Null) || value == "disabled" => {}
            "include"
                if matches!(value, Value::Null) || value.as_array().is_some_and(Vec::is_empty) => {}
            "reasoning"
                if matches!(value, Value::Null)
                    || value
                        .as_object()
                        .is_some_and(|r| r.get("effort").is_none_or(Value::is_null)) => {}
            "background" | "truncation" | "include" | "reasoning" => {
                return Err(ResponsesError::unsupported(
                    key.as_str(),
                    format!("`{key}` is not supported here with this value"),
                ))
            }
            k if IGNORED.contains(&k) => {}
            _ => {
                return Err(ResponsesError::unsupported(
                    key.as_str(),
                    format!("`{key}` is not supported on this gateway's /v1/responses"),
                ))
            }
        }
    }
    chat.insert("messages".into(), Value::Array(messages));
    if stream {
        chat.insert("stream".into(), Value::Bool(true));
        chat.insert("stream_options".into(), json!({"include_usage": true}));
    }
    let chat_body = serde_json::to_vec(&Value::Object(chat)).map_err(|e| ResponsesError {
        param: None,
        code: "invalid_request",
        message: e.to_string(),
    })?;
    Ok(ChatTranslation {
        chat_body,
        stream,
        echo,
    })
}

/// The input items as chat messages; consecutive `function_call` items become one assistant
/// message with several `tool_calls`.
fn input_items(items: &[Value], messages: &mut Vec<Value>) -> Result<(), ResponsesError> {
    for (i, item) in items.iter().enumerate() {
        let at = |member: &str| format!("input[{i}]{member}");
        let Value::Object(item) = item else {
            return Err(ResponsesError::invalid(
                at(""),
                "an input item must be an object",
            ));
        };
        let kind = match item.get("type") {
            None | Some(Value::Null) => "message",
            Some(Value::String(t)) => t.as_str(),
            Some(_) => {
                return Err(ResponsesError::invalid(
                    at(".type"),
                    "`type` must be a string",
                ))
            }
        };
        match kind {
            "message" => {
                let role = match item.get("role").and_then(Value::as_str) {
                    Some(r @ ("user" | "assistant" | "system")) => r,
                    Some("developer") => "system",
                    _ => {
                        return Err(ResponsesError::invalid(
                            at(".role"),
                            "`role` must be one of user, assistant, system, developer",
                        ))
                    }
                };
                let content = message_content(item.get("content"), &at(".content"))?;
                messages.push(json!({"role": role, "content": content}));
            }
            "function_call" => {
                let call_id = string_member(item, "call_id", &at)?;
                let name = string_member(item, "name", &at)?;
                let arguments = string_member(item, "arguments", &at)?;
                let call = json!({
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                });
                // a run of calls is one assistant turn
                let merged = messages.last_mut().and_then(|m| {
                    (m.get("role") == Some(&json!("assistant")) && m.get("tool_calls").is_some())
                        .then(|| m.get_mut("tool_calls").and_then(Value::as_array_mut))
                        .flatten()
                });
                match merged {
                    Some(calls) => calls.push(call),
                    None => messages.push(json!({
                        "role": "assistant",
                        "content": null,
                        "tool_calls": [call],
                    })),
                }
            }
            "function_call_output" => {
                let call_id = string_member(item, "call_id", &at)?;
                let output = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(v @ Value::Array(_)) => parts_text(v, &at(".output"))?,
                    _ => {
                        return Err(ResponsesError::invalid(
                            at(".output"),
                            "`output` must be a string or an array of text parts",
                        ))
                    }
                };
                messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
            // a previous answer's reasoning, sent back as `input += response.output` does:
            // chat templates drop earlier turns' reasoning, so it is dropped here too
            "reasoning" => {}
            other => {
                return Err(ResponsesError::unsupported(
                    at(".type"),
                    format!("input items of type `{other}` are not supported here"),
                ))
            }
        }
    }
    Ok(())
}

fn string_member(
    item: &Map<String, Value>,
    name: &str,
    at: &dyn Fn(&str) -> String,
) -> Result<String, ResponsesError> {
    match item.get(name) {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(ResponsesError::invalid(
            at(&format!(".{name}")),
            format!("`{name}` must be a string"),
        )),
    }
}

/// A message's content: a string, or its text parts as chat text parts (the template joins
/// them as it joins a chat message's parts).
fn message_content(content: Option<&Value>, at: &str) -> Result<Value, ResponsesError> {
    match content {
        Some(Value::String(s)) => Ok(Value::String(s.clone())),
        Some(v @ Value::Array(_)) => {
            let parts = text_parts(v, at)?
                .into_iter()
                .map(|text| json!({"type": "text", "text": text}))
                .collect();
            Ok(Value::Array(parts))
        }
        _ => Err(ResponsesError::invalid(
            at,
            "`content` must be a string or an array of content parts",
        )),
    }
}

/// The text of `input_text` / `output_text` / `refusal` parts, concatenated.
fn parts_text(parts: &Value, at: &str) -> Result<String, ResponsesError> {
    Ok(text_parts(parts, at)?.concat())
}

/// The text of each `input_text` / `output_text` / `refusal` part.
fn text_parts(parts: &Value, at: &str) -> Result<Vec<String>, ResponsesError> {
    let mut texts = Vec::new();
    for (j, part) in parts.as_array().into_iter().flatten().enumerate() {
        let kind = part.get("type").and_then(Value::as_str);
        let member = match kind {
            Some("input_text" | "output_text" | "text") => "text",
            Some("refusal") => "refusal",
            Some(other) => {
                return Err(ResponsesError::unsupported(
                    format!("{at}[{j}].type"),
                    format!("content parts of type `{other}` are not supported here"),
                ))
            }
            None => {
                return Err(ResponsesError::invalid(
                    format!("{at}[{j}].type"),
                    "a content part needs a `type`",
                ))
            }
        };
        match part.get(member) {
            Some(Value::String(s)) => texts.push(s.clone()),
            _ => {
                return Err(ResponsesError::invalid(
                    format!("{at}[{j}].{member}"),
                    format!("`{member}` must be a string"),
                ))
            }
        }
    }
    Ok(texts)
}

/// A Responses function tool (`{type: "function", name, description, parameters, strict}`) as a
/// chat tool (`{type: "function", function: {…}}`).
fn function_tool(i: usize, tool: &Value) -> Result<Value, ResponsesError> {
    let at = format!("tools[{i}]");
    let Value::Object(tool) = tool else {
        return Err(ResponsesError::invalid(at, "a tool must be an object"));
    };
    match tool.get("type").and_then(Value::as_str) {
        Some("function") => {}
        Some(other) => {
            return Err(ResponsesError::unsupported(
                format!("{at}.type"),
                format!("tools of type `{other}` are not supported here; only `function`"),
            ))
        }
        None => {
            return Err(ResponsesError::invalid(
                format!("{at}.type"),
                "a tool needs a `type`",
            ))
        }
    }
    let mut function = Map::new();
    match tool.get("name") {
        Some(Value::String(n)) if !n.is_empty() => {
            function.insert("name".into(), Value::String(n.clone()));
        }
        _ => {
            return Err(ResponsesError::invalid(
                format!("{at}.name"),
                "`name` must be a non-empty string",
            ))
        }
    }
    for member in ["description", "parameters", "strict"] {
        match tool.get(member) {
            None | Some(Value::Null) => {}
            Some(v) => {
                function.insert(member.into(), v.clone());
            }
        }
    }
    Ok(json!({"type": "function", "function": function}))
}

fn tool_choice(value: &Value) -> Result<Option<Value>, ResponsesError> {
    match value {
        Value::Null => Ok(None),
        Value::String(s) if matches!(s.as_str(), "auto" | "none" | "required") => {
            Ok(Some(value.clone()))
        }
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            match o.get("name") {
                Some(Value::String(n)) => {
                    Ok(Some(json!({"type": "function", "function": {"name": n}})))
                }
                _ => Err(ResponsesError::invalid(
                    "tool_choice.name",
                    "`name` must be a string",
                )),
            }
        }
        _ => Err(ResponsesError::unsupported(
            "tool_choice",
            "`tool_choice` must be auto, none, required or a function",
        )),
    }
}

/// `text.format` as a chat `response_format`.
fn text_format(value: &Value) -> Result<Option<Value>, ResponsesError> {
    let format = match value {
        Value::Null => return Ok(None),
        Value::Object(text) => match text.get("format") {
            None | Some(Value::Null) => return Ok(None),
            Some(f) => f,
        },
        _ => return Err(ResponsesError::invalid("text", "`text` must be an object")),
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let mut schema = Map::new();
            for member in ["name", "schema", "strict", "description"] {
                if let Some(v) = format.get(member).filter(|v| !v.is_null()) {
                    schema.insert(member.into(), v.clone());
                }
            }
            if !schema.contains_key("schema") {
                return Err(ResponsesError::invalid(
                    "text.format.schema",
                    "a `json_schema` format needs a `schema`",
                ));
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": schema})))
        }
        _ => Err(ResponsesError::unsupported(
            "text.format.type",
            "`text.format.type` must be text, json_object or json_schema",
        )),
    }
}

/// The first top-level member name given twice in `body` (compared unescaped), if any; `None`
/// also for a body that is not a JSON object (the caller's parse reports that).
fn duplicate_member(body: &[u8]) -> Option<String> {
    use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, Visitor};
    struct Names;
    impl<'de> Visitor<'de> for Names {
        type Value = Option<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut seen = std::collections::HashSet::new();
            while let Some(spine_core::JsonKey(key)) = map.next_key()? {
                map.next_value::<IgnoredAny>()?;
                if !seen.insert(key.clone()) {
                    return Ok(Some(key.into_owned()));
                }
            }
            Ok(None)
        }
    }
    impl<'de> DeserializeSeed<'de> for Names {
        type Value = Option<String>;
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_map(self)
        }
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    Names.deserialize(&mut de).ok().flatten()
}
