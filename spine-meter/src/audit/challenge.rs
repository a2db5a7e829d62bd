//! Challenge requests: plausible chats for nodes with little traffic (design brief §10).
//!
//! A challenge goes through the normal path (metered, billed to a platform account, routed
//! over the tunnel), so a node sees an ordinary request. Its body is drawn from templates ×
//! topics × languages × sampling settings, so no fixed prompt list gives challenges away; a node
//! that behaves only for requests it takes for challenges is still caught by the audits of its
//! real traffic, which are chosen after the fact.

use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use spine_core::ModelId;

const TEMPLATES: &[&str] = &[
    "Write a short paragraph about {}.",
    "Explain {} in simple words.",
    "Give me three facts about {}.",
    "Tell me a short story involving {}.",
    "What should a beginner know about {}?",
    "Summarize the main ideas of {} in a few sentences.",
    "Describe {} to a ten-year-old.",
    "List some pros and cons of {}.",
];

const TOPICS: &[&str] = &[
    "the water cycle",
    "learning to cook",
    "a trip to the mountains",
    "how bees make honey",
    "the history of bread",
    "saving money",
    "volcanoes",
    "the night sky",
    "a lighthouse keeper",
    "writing a good email",
    "recycling",
    "the first computers",
    "growing tomatoes",
    "a friendly dragon",
    "the ocean tides",
    "learning a new language",
    "training for a marathon",
    "the invention of the printing press",
];

/// Whole requests in other languages, used now and then.
const OTHER_LANGUAGES: &[&str] = &[
    "Escribe un párrafo corto sobre el mar.",
    "Explique la photosynthèse en quelques phrases.",
    "Schreibe drei Sätze über den Herbst.",
    "Descreva uma manhã na praia.",
    "Scrivi una breve storia su un gatto.",
];

/// A plausible chat completions body for `model`, drawn from `seed`: a prompt from templates ×
/// topics (sometimes another language), greedy (3 in 4) or sampled at 0.6–1.0 with a seed, 48–160
/// `max_tokens`, streamed or not. Only members the auditor accepts
/// ([`auditable`](super::auditable)) are used, so every answered challenge can be scored.
pub fn challenge_body(model: &ModelId, seed: u64) -> Value {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let content = if rng.random_bool(0.2) {
        OTHER_LANGUAGES[rng.random_range(0..OTHER_LANGUAGES.len())].to_owned()
    } else {
        let template = TEMPLATES[rng.random_range(0..TEMPLATES.len())];
        let topic = TOPICS[rng.random_range(0..TOPICS.len())];
        template.replace("{}", topic)
    };
    let mut body = json!({
        "model": model.as_str(),
        "messages": [{"role": "user", "content": content}],
        "max_tokens": rng.random_range(48..=160),
        "stream": rng.random_bool(0.6),
    });
    // mostly greedy: the greedy statistic is the one with power (docs/trust.md); some sampled
    // ones so that challenges look like the traffic around them
    if rng.random_bool(0.75) {
        body["temperature"] = json!(0);
    } else {
        body["temperature"] = json!((rng.random_range(6..=10) as f64) / 10.0);
        body["seed"] = json!(rng.random_range(0..1_000_000u32));
    }
    body
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn challenges_vary_and_are_always_auditable() {
        let model = ModelId::new("m");
        let mut prompts = std::collections::HashSet::new();
        for seed in 0..200 {
            let body = challenge_body(&model, seed);
            let bytes = serde_json::to_vec(&body).unwrap();
            assert!(
                super::super::auditable(spine_core::RequestKind::ChatCompletions, &bytes).is_ok(),
                "{body}"
            );
            prompts.insert(body["messages"][0]["content"].as_str().unwrap().to_owned());
        }
        assert!(prompts.len() > 60, "{} distinct prompts", prompts.len());
        assert_eq!(challenge_body(&model, 7), challenge_body(&model, 7));
    }
}
