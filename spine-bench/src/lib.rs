//! Benchmark harness for spine (issue 7): a fast mock OpenAI-compatible engine ([`mock`]) and a
//! load generator ([`load`]) that measures latency from each request's scheduled send time.
//!
//! The two binaries wrap them: `spine-mock-engine` (serves [`mock::MockConfig`] and prints its
//! address as one JSON line) and `spine-load` (`run`: one measurement, one JSON line;
//! `table`: the side-by-side tables with ratios from those lines). `scripts/bench.sh` drives
//! both against the direct path, spine and LiteLLM; `docs/benchmarks.md` has the results.

pub mod load;
pub mod mock;
pub mod table;
