//! Reading a JSON value that refuses an object naming a member twice, at any depth.

use std::fmt;

use serde_json::Value;
use spine_core::JsonKey as Key;

/// `json` as a [`Value`], refusing an object at any depth that names a member twice: the
/// choice may be passed on as it came, and SDKs disagree on which duplicate wins (serde's
/// derived structs refuse it), so the text counted (the last one here) might not be the text
/// shown, or the caller's SDK might fail on an answer it paid for.
pub(super) fn unique_value(json: &str) -> Result<Value, &'static str> {
    use serde::de::DeserializeSeed;
    let mut de = serde_json::Deserializer::from_str(json);
    let value = Unique
        .deserialize(&mut de)
        .and_then(|v| de.end().map(|()| v))
        .map_err(|e| {
            if e.to_string().starts_with(DUPLICATE) {
                "a choice names a member twice"
            } else {
                "a choice is not valid JSON"
            }
        })?;
    Ok(value)
}

const DUPLICATE: &str = "duplicate member";

/// Reads any JSON value as [`Value`] does, refusing a duplicate member name.
struct Unique;

impl<'de> serde::de::DeserializeSeed<'de> for Unique {
    type Value = Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Unique {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(Unique)? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = serde_json::Map::new();
        while let Some(Key(key)) = map.next_key::<Key<'de>>()? {
            if out.contains_key(key.as_ref()) {
                return Err(serde::de::Error::custom(DUPLICATE));
            }
            let value = map.next_value_seed(Unique)?;
            out.insert(key.into_owned(), value);
        }
        Ok(Value::Object(out))
    }
}
