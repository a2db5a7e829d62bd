//! The agent's decoder of the gateway's handshake messages (challenge, accepted) over arbitrary
//! bytes, and a hello answering a decoded challenge: errors, never panics.
#![no_main]
use libfuzzer_sys::fuzz_target;
use spine_transport::handshake::{decode_gateway_message, GatewayMessage, Hello};

fuzz_target!(|bytes: &[u8]| {
    if let Ok(GatewayMessage::Challenge(challenge)) = decode_gateway_message(bytes) {
        // whatever the challenge holds, signing over it and verifying round-trips
        let identity = spine_transport::NodeIdentity::from_seed(&[3u8; 32]);
        let descriptor = spine_core::NodeDescriptor {
            engine: spine_core::EngineKind::LlamaCpp,
            models: vec![],
            vram_mib: 0,
            max_concurrency: 1,
            agent_version: "fuzz".into(),
        };
        let hello = Hello::sign(&identity, &challenge, "localhost", descriptor);
        if challenge.protocol_version == spine_transport::PROTOCOL_VERSION {
            assert!(hello.verify(&challenge).is_ok());
        }
    }
});
