//! Wall-clock time as the ledger, the tunnel and the gateway record it.

/// Milliseconds since the Unix epoch, now: 0 for a clock before 1970, `i64::MAX` past the
/// year 292 million.
pub fn unix_time_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests;
