use super::{csv_field, parse_day, with_thousands};

#[test]
fn counts_have_thousands_separators() {
    assert_eq!(with_thousands(0), "0");
    assert_eq!(with_thousands(999), "999");
    assert_eq!(with_thousands(10_000), "10,000");
    assert_eq!(with_thousands(1_234_567), "1,234,567");
}

#[test]
fn days_parse_back_to_the_epoch_count() {
    assert_eq!(parse_day("1970-01-01"), Some(0));
    assert_eq!(parse_day("2025-12-02"), Some(20_424));
    assert_eq!(parse_day("2025-13-02"), None);
    assert_eq!(parse_day("x"), None);
}

#[test]
fn csv_fields_are_quoted_and_formulas_defused() {
    assert_eq!(csv_field("a\"b"), "\"a\"\"b\"");
    assert_eq!(csv_field("=cmd()"), "\"'=cmd()\"");
}
