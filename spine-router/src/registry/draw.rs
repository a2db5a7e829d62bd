//! The weighted draw of a pick.

use rand::Rng;

/// An index drawn with probability proportional to the weights (element 2), skipping `not`;
/// `None` when nothing is left to draw.
pub(super) fn weighted_draw<A, B, D>(
    items: &[(A, B, f64, D)],
    not: Option<usize>,
) -> Option<usize> {
    let eligible = |i: usize| Some(i) != not;
    let count = (0..items.len()).filter(|&i| eligible(i)).count();
    if count == 0 {
        return None;
    }
    let total: f64 = (0..items.len())
        .filter(|&i| eligible(i))
        .map(|i| items[i].2)
        .sum();
    let mut rng = rand::rng();
    if !(total.is_finite() && total > 0.0) {
        let k = rng.random_range(0..count);
        return (0..items.len()).filter(|&i| eligible(i)).nth(k);
    }
    let mut r = rng.random_range(0.0..total);
    let mut last = None;
    for i in (0..items.len()).filter(|&i| eligible(i)) {
        last = Some(i);
        if r < items[i].2 {
            return Some(i);
        }
        r -= items[i].2;
    }
    last
}
