#[test]
fn unix_time_ms_is_after_2020() {
    assert!(super::unix_time_ms() > 1_577_836_800_000);
}
