//! The audit's readers over arbitrary bytes (design brief §10): a caller's request body
//! (`auditable`) and a reference's positions against a delivered text (`observations`, fed
//! byte-split pieces and log-probabilities from the input). Errors or observations, never a
//! panic; every observation's statistic is one the test knows.
#![no_main]
use libfuzzer_sys::fuzz_target;
use spine_core::RequestKind;
use spine_meter::audit::{
    auditable, observations, Observation, SamplingMode, ScoreConfig, ScoredToken, Sprt, SprtConfig,
    TopToken,
};

fuzz_target!(|bytes: &[u8]| {
    let kind = match bytes.first().map(|b| b % 3) {
        Some(0) => RequestKind::ChatCompletions,
        Some(1) => RequestKind::Completions,
        _ => RequestKind::Embeddings,
    };
    let _ = auditable(kind, bytes);
    // positions: each input byte b starts a piece of (b % 4) bytes of the text, with two top
    // tokens whose log-probabilities come from the next bytes
    let text = bytes;
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < bytes.len() && tokens.len() < 512 {
        let len = usize::from(bytes[i] % 4);
        let piece = text
            .get(i..(i + len).min(text.len()))
            .unwrap_or(&[])
            .to_vec();
        let lp = |k: usize| -f64::from(bytes.get(i + k).copied().unwrap_or(0)) / 16.0;
        tokens.push(ScoredToken {
            bytes: piece.clone(),
            top: vec![
                TopToken {
                    bytes: piece,
                    logprob: lp(1),
                },
                TopToken {
                    bytes: bytes.get(i..i + 1).unwrap_or(&[]).to_vec(),
                    logprob: lp(2),
                },
            ],
        });
        i += len.max(1);
    }
    let modes = [
        SamplingMode::Greedy,
        SamplingMode::Sampled { temperature: 1.0 },
        SamplingMode::Sampled { temperature: 0.05 },
    ];
    for mode in modes {
        if let Ok(obs) = observations(&tokens, text, mode, &ScoreConfig::default()) {
            let config = SprtConfig::default();
            let mut test = Sprt::default();
            for o in obs {
                if let Observation::Sampled {
                    surprisal,
                    bound,
                    cap,
                } = o
                {
                    assert!(cap > 0.0 && (0.0..=cap).contains(&surprisal));
                    assert!((0.0..=cap).contains(&bound));
                }
                test.observe(&config, o);
                assert!(test.llr.is_finite());
            }
        }
    }
});
