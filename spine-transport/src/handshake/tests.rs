#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;

fn descriptor() -> NodeDescriptor {
    spine_test_support::smollm2_node("test")
}

fn challenge() -> Challenge {
    Challenge {
        nonce: "ab".repeat(32),
        gateway_id: "gw-1".into(),
        issued_at_ms: 1_700_000_000_000,
        protocol_version: 2,
    }
}

#[test]
fn signing_bytes_are_exact() {
    let c = Challenge {
        nonce: "0a".into(),
        gateway_id: "g".into(),
        issued_at_ms: 258,
        protocol_version: 1,
    };
    let mut expected = b"spine-tunnel-v2\0".to_vec();
    expected.extend_from_slice(&[0, 0, 0, 2, b'0', b'a']);
    expected.extend_from_slice(&[0, 0, 0, 1, b'g']);
    expected.extend_from_slice(&[0, 0, 0, 2, b'h', b'n']);
    expected.extend_from_slice(&[0, 0, 0, 0, 0, 0, 1, 2]);
    expected.extend_from_slice(&[0, 0, 0, 2]);
    assert_eq!(signing_bytes(&c, "hn", 2), expected);
}

#[test]
fn gateway_names_are_canonical() {
    assert_eq!(gateway_name("GW.Example.COM."), "gw.example.com");
    assert_eq!(gateway_name("[::1]"), "::1");
    assert_eq!(gateway_name("127.0.0.1"), "127.0.0.1");
}

#[test]
fn signed_hello_verifies_and_round_trips() {
    let id = NodeIdentity::from_seed(&[3u8; 32]);
    let c = challenge();
    let hello = Hello::sign(&id, &c, "GW.example.com", descriptor());
    assert_eq!(hello.gateway_name, "gw.example.com");
    let json = serde_json::to_vec(&AgentMessage::Hello(hello.clone())).unwrap();
    let decoded = decode_hello(&json).unwrap();
    assert_eq!(decoded, hello);
    assert_eq!(decoded.verify(&c).unwrap(), id.verifying_key());

    // another challenge (replay) fails
    let mut other = c.clone();
    other.nonce = "cd".repeat(32);
    assert_eq!(decoded.verify(&other), Err(RefusalReason::BadSignature));
    // a relay that rewrites the name the agent signed
    let mut renamed = hello.clone();
    renamed.gateway_name = "real.example.com".into();
    assert_eq!(renamed.verify(&c), Err(RefusalReason::BadSignature));
    // another key claims the signature
    let mut forged = hello.clone();
    forged.public_key = NodeIdentity::from_seed(&[4u8; 32]).public_key_text();
    assert_eq!(forged.verify(&c), Err(RefusalReason::BadSignature));
    // garbage signature
    let mut garbage = hello;
    garbage.signature = "not base64!".into();
    assert_eq!(garbage.verify(&c), Err(RefusalReason::MalformedHandshake));
}

#[test]
fn decode_hello_errors_are_exact() {
    assert_eq!(
        decode_hello(b"not json"),
        Err(RefusalReason::MalformedHandshake)
    );
    assert_eq!(
        decode_hello(br#"{"type":"challenge","protocol_version":1}"#),
        Err(RefusalReason::MalformedHandshake)
    );
    assert_eq!(
        decode_hello(br#"{"type":"hello","protocol_version":3,"whatever":true}"#),
        Err(RefusalReason::UnsupportedProtocol)
    );
    assert_eq!(
        decode_hello(br#"{"type":"hello","protocol_version":1,"whatever":true}"#),
        Err(RefusalReason::UnsupportedProtocol)
    );
    assert_eq!(
        decode_hello(br#"{"type":"hello","protocol_version":2}"#),
        Err(RefusalReason::MalformedHandshake)
    );
    assert_eq!(
        decode_hello(br#"{"type":"hello"}"#),
        Err(RefusalReason::MalformedHandshake)
    );
}

#[test]
fn gateway_messages_have_the_documented_shape() {
    let msg = GatewayMessage::Challenge(challenge());
    let v: serde_json::Value = serde_json::to_value(&msg).unwrap();
    assert_eq!(
        v,
        serde_json::json!({
            "type": "challenge",
            "nonce": "ab".repeat(32),
            "gateway_id": "gw-1",
            "issued_at_ms": 1_700_000_000_000u64,
            "protocol_version": 2
        })
    );
    let acc = GatewayMessage::Accepted(Accepted {
        node_id: NodeId::new("node_1"),
    });
    assert_eq!(
        serde_json::to_string(&acc).unwrap(),
        r#"{"type":"accepted","node_id":"node_1"}"#
    );
    assert_eq!(
        decode_gateway_message(br#"{"type":"accepted","node_id":"n"}"#).unwrap(),
        GatewayMessage::Accepted(Accepted {
            node_id: NodeId::new("n")
        })
    );
}

#[test]
fn fresh_challenges_differ() {
    let a = Challenge::generate("gw", 1).unwrap();
    let b = Challenge::generate("gw", 1).unwrap();
    assert_eq!(a.nonce.len(), 64);
    assert_ne!(a.nonce, b.nonce);
}
