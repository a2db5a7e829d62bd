//! Routing pick at 8, 64 and 512 routable nodes (issue 7): `NodeRegistry::pick` plus dropping
//! the lease, through the registry's public API only. Half the nodes serve the benchmarked
//! model, so the pick also filters. Run: `cargo bench -p spine-router --bench pick`.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use spine_core::{EngineKind, ModelDescriptor, ModelId, NodeDescriptor, NodeId};
use spine_router::NodeRegistry;

fn registry(nodes: usize) -> NodeRegistry {
    let registry = NodeRegistry::new();
    for i in 0..nodes {
        let model = if i % 2 == 0 { "smollm2" } else { "other" };
        let descriptor = NodeDescriptor {
            engine: EngineKind::LlamaCpp,
            models: vec![ModelDescriptor {
                id: ModelId::new(model),
                max_context_tokens: Some(8192),
                endpoints: None,
            }],
            vram_mib: 24_576,
            max_concurrency: 64,
            agent_version: "bench".to_owned(),
        };
        registry.node_ready(&NodeId::new(format!("node_{i}")), &descriptor);
    }
    registry
}

fn pick(c: &mut Criterion) {
    let model = ModelId::new("smollm2");
    let mut group = c.benchmark_group("routing_pick");
    group.throughput(Throughput::Elements(1));
    for nodes in [8usize, 64, 512] {
        let registry = registry(nodes);
        group.bench_with_input(BenchmarkId::from_parameter(nodes), &nodes, |b, _| {
            b.iter(|| {
                let lease = registry.pick(std::hint::black_box(&model)).unwrap();
                std::hint::black_box(lease.node());
            });
        });
    }
    group.finish();
}

criterion_group!(benches, pick);
criterion_main!(benches);
