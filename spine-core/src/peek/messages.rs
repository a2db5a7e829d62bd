//! The members of a chat completion body below the top level: `messages` and `tools`, checked
//! against the allowlists of [`super::fields`].

use serde_json::Value;

use super::{fields, PeekError};

const PREFILL: &str =
    "the last message must not be an assistant message: continuing an assistant turn (prefill) is not supported";

pub(super) const CONTENT_EXPECTED: &str =
    "expected a string or an array of content parts (null only for an assistant message with tool_calls)";

fn invalid(path: String, reason: &'static str) -> PeekError {
    PeekError::InvalidMessage { path, reason }
}

/// Refuses the first member of `object` that `allowed` does not hold, as
/// [`PeekError::UnrecognizedArgument`] with its path (`{at}.{name}`).
fn check_members(
    object: &serde_json::Map<String, Value>,
    allowed: &[&str],
    at: &str,
) -> Result<(), PeekError> {
    match object.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(name) => Err(PeekError::UnrecognizedArgument {
            param: format!("{at}.{name}"),
        }),
        None => Ok(()),
    }
}

/// Checks the `messages` (and `tools`) of a chat completion body before anything is counted
/// or forwarded (OpenAI API reference, chat completions; design brief §7: a malformed request
/// is a 400 and is never forwarded).
///
/// `messages` must be a non-empty array of objects, each with a `role` of `system`,
/// `developer`, `user`, `assistant` or `tool`, only the members its role allows (the tables of
/// `peek/fields.rs`: anything else is [`PeekError::UnrecognizedArgument`] with its path), and a
/// `content` that is
/// - a string, or
/// - an array of content parts, each `{"type":"text","text":<string>}` — any other part type
///   (`image_url`, `input_audio`, `file`, ...) is refused, because the text models spine serves
///   cannot take it, or
/// - `null` or absent, only for an `assistant` message with a non-empty `tool_calls` array.
///
/// An assistant message's `tool_calls` are objects of `id`, `type` (`function`) and `function`
/// (`name`, `arguments`); its `audio` and `function_call` may only be `null`. `tools`, when
/// set, is an array of `{"type":"function","function":{name, description, parameters,
/// strict}}`.
///
/// # Errors
///
/// [`PeekError::InvalidMessage`] naming the first offending path, e.g. `messages[0].content` or
/// `messages[0].content[1].type` (reason `unsupported content part type for this model`);
/// [`PeekError::UnrecognizedArgument`] for a member outside the allowlist;
/// [`PeekError::NotObject`] when `body` is not an object.
pub fn validate_chat_messages(body: &Value) -> Result<(), PeekError> {
    let body = body.as_object().ok_or(PeekError::NotObject)?;
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .filter(|m| !m.is_empty())
        .ok_or_else(|| {
            invalid(
                "messages".to_owned(),
                "expected a non-empty array of message objects",
            )
        })?;
    for (i, message) in messages.iter().enumerate() {
        let message = message
            .as_object()
            .ok_or_else(|| invalid(format!("messages[{i}]"), "expected an object"))?;
        let role = message
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid(format!("messages[{i}].role"), "expected a string"))?;
        let allowed = fields::message_members(role).ok_or_else(|| {
            invalid(
                format!("messages[{i}].role"),
                "expected one of system, developer, user, assistant, tool",
            )
        })?;
        check_members(message, allowed, &format!("messages[{i}]"))?;
        for name in fields::NULL_ONLY_MESSAGE_MEMBERS {
            if message.get(name).is_some_and(|v| !v.is_null()) {
                return Err(invalid(
                    format!("messages[{i}].{name}"),
                    "not supported by this gateway (only null)",
                ));
            }
        }
        // members an engine reads as text: llama.cpp answers 500 to one that is null or a number
        for name in fields::STRING_MESSAGE_MEMBERS {
            if message.get(name).is_some_and(|v| !v.is_string()) {
                return Err(invalid(
                    format!("messages[{i}].{name}"),
                    "expected a string",
                ));
            }
        }
        if let Some(calls) = message.get("tool_calls").filter(|t| !t.is_null()) {
            check_tool_calls(calls, i)?;
        }
        match message.get("content") {
            Some(Value::String(_)) => {}
            Some(Value::Array(parts)) => {
                for (j, part) in parts.iter().enumerate() {
                    let path = format!("messages[{i}].content[{j}]");
                    let part = part
                        .as_object()
                        .ok_or_else(|| invalid(path.clone(), "expected an object"))?;
                    match part.get("type").and_then(Value::as_str) {
                        Some("text") => {
                            if !part.get("text").is_some_and(Value::is_string) {
                                return Err(invalid(format!("{path}.text"), "expected a string"));
                            }
                        }
                        Some(_) => {
                            return Err(invalid(
                                format!("{path}.type"),
                                "unsupported content part type for this model",
                            ))
                        }
                        None => return Err(invalid(format!("{path}.type"), "expected a string")),
                    }
                    check_members(part, &fields::CONTENT_PART_MEMBERS, &path)?;
                }
            }
            None | Some(Value::Null) => {
                let tool_calls = message
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .is_some_and(|t| !t.is_empty());
                if role != "assistant" || !tool_calls {
                    return Err(invalid(format!("messages[{i}].content"), CONTENT_EXPECTED));
                }
            }
            Some(_) => return Err(invalid(format!("messages[{i}].content"), CONTENT_EXPECTED)),
        }
    }
    // an assistant message last is a prefill: llama.cpp continues that turn instead of starting
    // a new one, and the meter's count (a new turn, with the generation prompt) would disagree
    // with the engine's, flagging an honest node or leaking tokens
    let last = messages.len().saturating_sub(1);
    if messages
        .last()
        .and_then(|m| m.get("role"))
        .and_then(Value::as_str)
        == Some("assistant")
    {
        return Err(invalid(format!("messages[{last}].role"), PREFILL));
    }
    match body.get("tools") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Array(tools)) => tools
            .iter()
            .enumerate()
            .try_for_each(|(i, tool)| check_tool(tool, i)),
        Some(_) => Err(invalid("tools".to_owned(), "expected an array of tools")),
    }
}

/// One `tools` entry: `{"type":"function","function":{"name":…,…}}`, members allowlisted.
fn check_tool(tool: &Value, i: usize) -> Result<(), PeekError> {
    let at = format!("tools[{i}]");
    let tool = tool
        .as_object()
        .ok_or_else(|| invalid(at.clone(), "expected an object"))?;
    if tool.get("type").and_then(Value::as_str) != Some("function") {
        return Err(invalid(
            format!("{at}.type"),
            "only tools of type function are supported",
        ));
    }
    check_members(tool, &fields::TOOL_MEMBERS, &at)?;
    let function = tool
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| invalid(format!("{at}.function"), "expected an object"))?;
    if !function.get("name").is_some_and(Value::is_string) {
        return Err(invalid(format!("{at}.function.name"), "expected a string"));
    }
    check_members(
        function,
        &fields::FUNCTION_MEMBERS,
        &format!("{at}.function"),
    )?;
    // typed as OpenAI types them: an engine handed another type fails the request (llama.cpp
    // answers 500 to a numeric or null `description`), and that is the caller's input
    check_member_type(
        function,
        "description",
        Value::is_string,
        "expected a string",
        &at,
    )?;
    check_member_type(
        function,
        "parameters",
        Value::is_object,
        "expected an object",
        &at,
    )?;
    check_member_type(
        function,
        "strict",
        |v| v.is_boolean() || v.is_null(),
        "expected a boolean",
        &at,
    )
}

/// `{at}.function.{member}`, when present, passes `is`: else a 400 naming the member, with
/// `reason`.
fn check_member_type(
    function: &serde_json::Map<String, Value>,
    member: &str,
    is: impl Fn(&Value) -> bool,
    reason: &'static str,
    at: &str,
) -> Result<(), PeekError> {
    match function.get(member) {
        Some(v) if !is(v) => Err(invalid(format!("{at}.function.{member}"), reason)),
        _ => Ok(()),
    }
}

/// An assistant message's `tool_calls`: an array of `{id, type: "function", function: {name,
/// arguments}}`, members allowlisted.
fn check_tool_calls(calls: &Value, i: usize) -> Result<(), PeekError> {
    let calls = calls.as_array().ok_or_else(|| {
        invalid(
            format!("messages[{i}].tool_calls"),
            "expected an array of tool calls",
        )
    })?;
    for (j, call) in calls.iter().enumerate() {
        let at = format!("messages[{i}].tool_calls[{j}]");
        let call = call
            .as_object()
            .ok_or_else(|| invalid(at.clone(), "expected an object"))?;
        check_members(call, &fields::TOOL_CALL_MEMBERS, &at)?;
        // as OpenAI requires them: llama.cpp answers 500 to a call without `type` or
        // `function.arguments`, or with a null or numeric `id`
        if call.get("id").is_some_and(|id| !id.is_string()) {
            return Err(invalid(format!("{at}.id"), "expected a string"));
        }
        if call.get("type").and_then(Value::as_str) != Some("function") {
            return Err(invalid(
                format!("{at}.type"),
                "only tool calls of type function are supported",
            ));
        }
        let function = call
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| invalid(format!("{at}.function"), "expected an object"))?;
        check_members(
            function,
            &fields::TOOL_CALL_FUNCTION_MEMBERS,
            &format!("{at}.function"),
        )?;
        for member in ["name", "arguments"] {
            if !function.get(member).is_some_and(Value::is_string) {
                return Err(invalid(
                    format!("{at}.function.{member}"),
                    "expected a string",
                ));
            }
        }
    }
    Ok(())
}
