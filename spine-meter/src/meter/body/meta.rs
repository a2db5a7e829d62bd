//! The stream's identity (`id`, `object`, `created`, `system_fingerprint`) as the
//! node's chunks gave it, and the usage chunk the gateway builds from it.

use bytes::Bytes;
use spine_core::Usage;

use super::super::bill::{encode_event, usage_json};
use super::super::node_json::Members;
use super::State;

impl State {
    /// Keeps the latest `id`, `object`, `created`, `system_fingerprint` of the chunk
    /// (allocating only when a value changes: they are the same on every chunk of a stream).
    pub(super) fn remember_meta(&mut self, members: &Members<'_>) {
        const KEYS: [&str; 4] = ["id", "object", "created", "system_fingerprint"];
        for key in KEYS {
            let Some(value) = members.get(key) else {
                continue;
            };
            match self.meta.iter_mut().find(|(k, _)| *k == key) {
                Some((_, old)) if old.get() == value.get() => {}
                Some((_, old)) => *old = value.to_owned(),
                None => self.meta.push((key, value.to_owned())),
            }
        }
    }

    /// The usage chunk sent before `[DONE]` when the caller asked for usage: the stream's
    /// `id`, `object`, `created`, the caller's catalog `model` (and `system_fingerprint` when the
    /// node sent one),
    /// `choices: []` and the billed `usage`.
    pub(super) fn usage_chunk(&self, billed: &Usage) -> Bytes {
        let meta = |key: &str| {
            self.meta
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| v.get().to_owned())
        };
        let request_id = self
            .ctx
            .as_ref()
            .map(|c| c.request_id.as_str().to_owned())
            .unwrap_or_default();
        let id = meta("id")
            .filter(|v| v.starts_with('"'))
            .unwrap_or_else(|| {
                serde_json::to_string(&format!("chatcmpl-{request_id}")).unwrap_or_default()
            });
        let object = meta("object")
            .filter(|v| v.starts_with('"'))
            .unwrap_or_else(|| format!("\"{}\"", self.settings.chunk_object()));
        let created = meta("created")
            .filter(|v| v.bytes().all(|b| b.is_ascii_digit()) && !v.is_empty())
            .unwrap_or_else(|| (spine_core::unix_time_ms() / 1000).to_string());
        let model = &self.model_json;
        let mut json =
            format!("{{\"id\":{id},\"object\":{object},\"created\":{created},\"model\":{model},");
        if let Some(fp) = meta("system_fingerprint") {
            json.push_str("\"system_fingerprint\":");
            json.push_str(&fp);
            json.push(',');
        }
        json.push_str("\"choices\":[],\"usage\":");
        json.push_str(&usage_json(billed));
        json.push('}');
        encode_event(&json)
    }
}
