//! Side-by-side markdown tables from [`Report`]s measured in one run.
//!
//! "Added" is always the target's percentile minus the direct path's percentile at the same
//! offered load in the same run (percentiles are not additive, so this is the usual
//! approximation: the difference of percentiles, not the percentile of differences). Ratios are
//! computed from the same run's numbers; nothing is compared against a number from another run.
//!
//! Scenarios understood (the `scenario` field): `non_streamed` (open loop at several rates),
//! `max_throughput` (closed loop), `stream_throughput` (closed loop, streamed, with the system
//! under test's CPU time) and `stream_latency` (open loop, streamed, paced by the engine).

use std::fmt::Write as _;

use crate::load::{Mode, Report};

fn ms(micros: f64) -> String {
    format!("{:.2}", micros / 1000.0)
}

fn rate_of(r: &Report) -> Option<f64> {
    match r.mode {
        Mode::Open { rate_per_sec } => Some(rate_per_sec),
        Mode::Closed { .. } => None,
    }
}

fn find<'a>(
    reports: &'a [Report],
    scenario: &str,
    target: &str,
    rate: Option<f64>,
) -> Option<&'a Report> {
    reports.iter().find(|r| {
        r.scenario == scenario
            && r.target == target
            && match (rate, rate_of(r)) {
                (Some(a), Some(b)) => (a - b).abs() < 1e-9,
                (None, _) => true,
                _ => false,
            }
    })
}

fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 && a.is_finite() {
        format!("{:.2}×", a / b)
    } else {
        "–".to_owned()
    }
}

/// Targets in first-seen order, `direct` first.
fn targets(reports: &[Report]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for r in reports {
        if !out.contains(&r.target) {
            out.push(r.target.clone());
        }
    }
    out.sort_by_key(|t| t != "direct");
    out
}

/// Renders every table the reports allow, in markdown.
pub fn render(reports: &[Report]) -> String {
    let mut s = String::new();
    let names = targets(reports);
    let others: Vec<&String> = names.iter().filter(|t| *t != "direct").collect();

    // 1. added latency at fixed rates
    let mut rates: Vec<f64> = reports
        .iter()
        .filter(|r| r.scenario == "non_streamed")
        .filter_map(rate_of)
        .collect();
    rates.sort_by(f64::total_cmp);
    rates.dedup();
    if !rates.is_empty() {
        let _ = writeln!(s, "### Non-streamed: latency at fixed offered rates (open loop, from the scheduled send time)\n");
        let mut head = "| offered req/s | direct p50 / p99 (ms, absolute) |".to_owned();
        let mut sep = "|---:|---:|".to_owned();
        for t in &others {
            let _ = write!(head, " {t} added p50 / p99 (ms) |");
            sep.push_str("---:|");
        }
        if others.len() >= 2 {
            let _ = write!(head, " {} / {} added p99 |", others[1], others[0]);
            sep.push_str("---:|");
        }
        let _ = writeln!(s, "{head}\n{sep}");
        for &rate in &rates {
            let direct = find(reports, "non_streamed", "direct", Some(rate));
            let mut row = format!("| {rate:.0} |");
            match direct {
                Some(d) if d.sustained() => {
                    let _ = write!(
                        row,
                        " {} / {} |",
                        ms(d.latency.p50_micros),
                        ms(d.latency.p99_micros)
                    );
                }
                Some(d) => {
                    let _ = write!(row, " saturated ({:.0} req/s done) |", d.ok_per_sec);
                }
                None => row.push_str(" – |"),
            }
            let mut added_p99 = Vec::new();
            for t in &others {
                match (find(reports, "non_streamed", t, Some(rate)), direct) {
                    (Some(r), Some(d)) if r.sustained() => {
                        let p50 = r.latency.p50_micros - d.latency.p50_micros;
                        let p99 = r.latency.p99_micros - d.latency.p99_micros;
                        added_p99.push(Some(p99));
                        let _ = write!(row, " +{} / +{} |", ms(p50), ms(p99));
                    }
                    (Some(r), _) => {
                        added_p99.push(None);
                        let _ = write!(
                            row,
                            " saturated ({:.0} req/s done, {} errors{}, {} dropped) |",
                            r.ok_per_sec,
                            r.errors,
                            statuses(r),
                            r.dropped
                        );
                    }
                    (None, _) => {
                        added_p99.push(None);
                        row.push_str(" not run (saturated at a lower rate) |");
                    }
                }
            }
            if others.len() >= 2 {
                match (
                    added_p99.first().copied().flatten(),
                    added_p99.get(1).copied().flatten(),
                ) {
                    (Some(a), Some(b)) => {
                        let _ = write!(row, " {} |", ratio(b, a.max(1.0)));
                    }
                    _ => row.push_str(" – |"),
                }
            }
            let _ = writeln!(s, "{row}");
        }
        // sustainable throughput at equal p99
        let best = |t: &str, p99_cap: f64| -> Option<(f64, f64)> {
            rates
                .iter()
                .rev()
                .filter_map(|&rate| find(reports, "non_streamed", t, Some(rate)))
                .filter(|r| r.sustained() && r.latency.p99_micros <= p99_cap)
                .find_map(|r| rate_of(r).map(|rate| (rate, r.latency.p99_micros)))
        };
        if others.len() >= 2 {
            let (a, b) = (others[0], others[1]);
            if let Some((rate_b, p99_b)) = best(b, f64::INFINITY) {
                let _ = writeln!(
                    s,
                    "\nSustainable at equal p99: {b} sustains at most {rate_b:.0} req/s of the offered rates (p99 {} ms there).",
                    ms(p99_b)
                );
                match best(a, p99_b) {
                    Some((rate_a, p99_a)) => {
                        let _ = writeln!(
                            s,
                            "{a} sustains {rate_a:.0} req/s with p99 {} ms ≤ that: {a}/{b} = {} (a lower bound: {rate_a:.0} req/s is the highest rate offered that {a} sustained).",
                            ms(p99_a),
                            ratio(rate_a, rate_b)
                        );
                    }
                    None => {
                        let _ =
                            writeln!(s, "{a} sustains none of the offered rates within that p99.");
                    }
                }
            }
        }
        s.push('\n');
    }

    // 2. closed-loop max throughput
    if reports.iter().any(|r| r.scenario == "max_throughput") {
        let _ = writeln!(s, "### Non-streamed: maximum throughput (closed loop)\n");
        let _ = writeln!(s, "| target | connections | ok req/s | errors | p50 / p99 (ms) | vs direct | SUT CPU s / request |");
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|");
        let direct = find(reports, "max_throughput", "direct", None).map(|r| r.ok_per_sec);
        for t in &names {
            if let Some(r) = find(reports, "max_throughput", t, None) {
                let conns = match r.mode {
                    Mode::Closed { concurrency } => concurrency,
                    Mode::Open { .. } => 0,
                };
                let cpu = r
                    .watched_cpu_secs
                    .filter(|_| r.ok > 0)
                    .map_or("–".to_owned(), |c| {
                        format!("{:.0} µs", c * 1e6 / r.ok as f64)
                    });
                let _ = writeln!(
                    s,
                    "| {t} | {conns} | {:.0} | {} | {} / {} | {} | {cpu} |",
                    r.ok_per_sec,
                    r.errors,
                    ms(r.latency.p50_micros),
                    ms(r.latency.p99_micros),
                    direct.map_or("–".to_owned(), |d| ratio(r.ok_per_sec, d)),
                );
            }
        }
        if others.len() >= 2 {
            let a = find(reports, "max_throughput", others[0], None);
            let b = find(reports, "max_throughput", others[1], None);
            if let (Some(a), Some(b)) = (a, b) {
                let _ = writeln!(
                    s,
                    "\n{}/{} max throughput = {}",
                    others[0],
                    others[1],
                    ratio(a.ok_per_sec, b.ok_per_sec)
                );
            }
        }
        s.push('\n');
    }

    // 3. streaming relay throughput
    if reports.iter().any(|r| r.scenario == "stream_throughput") {
        let _ = writeln!(
            s,
            "### Streaming: events relayed (closed loop, engine sends as fast as it can)\n"
        );
        let _ = writeln!(s, "| target | streams in flight | events/s received | ok streams/s | failed streams | SUT CPU s | events per SUT CPU-second | vs direct events/s |");
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|");
        let direct = find(reports, "stream_throughput", "direct", None).map(|r| r.events_per_sec);
        for t in &names {
            if let Some(r) = find(reports, "stream_throughput", t, None) {
                let conns = match r.mode {
                    Mode::Closed { concurrency } => concurrency,
                    Mode::Open { .. } => 0,
                };
                let (cpu, per_cpu) = match r.watched_cpu_secs {
                    Some(c) if c > 0.0 => {
                        (format!("{c:.2}"), format!("{:.0}", r.events as f64 / c))
                    }
                    _ => ("–".to_owned(), "–".to_owned()),
                };
                let _ = writeln!(
                    s,
                    "| {t} | {conns} | {:.0} | {:.0} | {} | {cpu} | {per_cpu} | {} |",
                    r.events_per_sec,
                    r.ok_per_sec,
                    r.errors,
                    direct.map_or("–".to_owned(), |d| ratio(r.events_per_sec, d)),
                );
            }
        }
        s.push('\n');
    }

    // 4. streaming per-event latency
    if reports.iter().any(|r| r.scenario == "stream_latency") {
        let _ = writeln!(
            s,
            "### Streaming: per-event latency (open loop, engine paced)\n"
        );
        let _ = writeln!(s, "| target | streams/s | event delay p50 / p99 (ms) | added event delay p50 / p99 (µs) | client ITL gap p50 / p99 (ms) | added ITL gap p99 (µs) | TTFT p50 / p99 (ms) |");
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|");
        let direct = find(reports, "stream_latency", "direct", None);
        for t in &names {
            if let Some(r) = find(reports, "stream_latency", t, None) {
                let rate = rate_of(r).unwrap_or(0.0);
                let (added_delay, added_gap) = match direct {
                    Some(d) if t != "direct" => (
                        if r.event_delay.count > 0 {
                            format!(
                                "{:+.0} / {:+.0}",
                                r.event_delay.p50_micros - d.event_delay.p50_micros,
                                r.event_delay.p99_micros - d.event_delay.p99_micros
                            )
                        } else {
                            "stamp not relayed".to_owned()
                        },
                        format!("{:+.0}", r.itl_gap.p99_micros - d.itl_gap.p99_micros),
                    ),
                    _ => ("–".to_owned(), "–".to_owned()),
                };
                let delay = if r.event_delay.count > 0 {
                    format!(
                        "{} / {}",
                        ms(r.event_delay.p50_micros),
                        ms(r.event_delay.p99_micros)
                    )
                } else {
                    "–".to_owned()
                };
                let sat = if r.sustained() {
                    ""
                } else {
                    " (not sustained)"
                };
                let _ = writeln!(
                    s,
                    "| {t}{sat} | {rate:.0} | {delay} | {added_delay} | {} / {} | {added_gap} | {} / {} |",
                    ms(r.itl_gap.p50_micros),
                    ms(r.itl_gap.p99_micros),
                    ms(r.ttft.p50_micros),
                    ms(r.ttft.p99_micros),
                );
            }
        }
        s.push('\n');
    }
    s
}

/// `" (429: 12, 0: 1)"`: a report's errors by HTTP status; `""` without.
fn statuses(r: &Report) -> String {
    if r.error_statuses.is_empty() {
        return String::new();
    }
    format!(" ({})", r.error_statuses_text())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use crate::load::Percentiles;

    fn report(
        target: &str,
        scenario: &str,
        mode: Mode,
        ok_per_sec: f64,
        p50: f64,
        p99: f64,
    ) -> Report {
        Report {
            target: target.into(),
            scenario: scenario.into(),
            mode,
            stream: false,
            elapsed_secs: 1.0,
            ok: ok_per_sec as u64,
            errors: 0,
            error_statuses: Default::default(),
            dropped: 0,
            ok_per_sec,
            events: 0,
            events_per_sec: 0.0,
            latency: Percentiles {
                count: 1,
                p50_micros: p50,
                p90_micros: p99,
                p99_micros: p99,
                p999_micros: p99,
                max_micros: p99,
            },
            ttft: Percentiles::default(),
            itl_gap: Percentiles::default(),
            event_delay: Percentiles::default(),
            watched_cpu_secs: None,
            sustained: false,
            slow_requests: Vec::new(),
            slow_events: Vec::new(),
        }
    }

    #[test]
    fn added_latency_ratios_and_saturation() {
        let open = |r| Mode::Open { rate_per_sec: r };
        let reports = vec![
            report("direct", "non_streamed", open(100.0), 100.0, 200.0, 400.0),
            report("spine", "non_streamed", open(100.0), 100.0, 500.0, 900.0),
            report(
                "litellm",
                "non_streamed",
                open(100.0),
                100.0,
                20_200.0,
                30_400.0,
            ),
            report("direct", "non_streamed", open(1000.0), 1000.0, 200.0, 400.0),
            report("spine", "non_streamed", open(1000.0), 1000.0, 600.0, 1400.0),
            report(
                "litellm",
                "non_streamed",
                open(1000.0),
                70.0,
                900_000.0,
                2e6,
            ),
            report(
                "direct",
                "max_throughput",
                Mode::Closed { concurrency: 64 },
                20_000.0,
                1.0,
                2.0,
            ),
            report(
                "spine",
                "max_throughput",
                Mode::Closed { concurrency: 64 },
                5_000.0,
                1.0,
                2.0,
            ),
            report(
                "litellm",
                "max_throughput",
                Mode::Closed { concurrency: 64 },
                80.0,
                1.0,
                2.0,
            ),
        ];
        let t = render(&reports);
        assert!(
            t.contains("| 100 | 0.20 / 0.40 | +0.30 / +0.50 | +20.00 / +30.00 | 60.00× |"),
            "{t}"
        );
        assert!(t.contains("| 1000 | 0.20 / 0.40 | +0.40 / +1.00 | saturated (70 req/s done, 0 errors, 0 dropped) | – |"), "{t}");
        assert!(t.contains("litellm sustains at most 100 req/s"), "{t}");
        assert!(
            t.contains("spine sustains 1000 req/s with p99 1.40 ms ≤ that: spine/litellm = 10.00×"),
            "{t}"
        );
        assert!(
            t.contains("| spine | 64 | 5000 | 0 | 0.00 / 0.00 | 0.25× | – |"),
            "{t}"
        );
        assert!(t.contains("spine/litellm max throughput = 62.50×"), "{t}");
    }

    #[test]
    fn a_saturated_rate_says_what_its_errors_were() {
        let open = Mode::Open {
            rate_per_sec: 3000.0,
        };
        let mut spine = report("spine", "non_streamed", open, 2900.0, 500.0, 900.0);
        spine.errors = 410;
        spine.error_statuses = [(0, 2), (429, 408)].into();
        let reports = vec![
            report("direct", "non_streamed", open, 3000.0, 200.0, 400.0),
            spine,
        ];
        let t = render(&reports);
        assert!(
            t.contains("| 3000 | 0.20 / 0.40 | saturated (2900 req/s done, 410 errors (0: 2, 429: 408), 0 dropped) |"),
            "{t}"
        );
    }
}
