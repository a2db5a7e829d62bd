use super::*;

#[test]
fn clones_share_one_slot_and_set_replaces() {
    let a = NodeSlot::new();
    let b = a.clone();
    assert_eq!(b.get(), None);
    a.set(NodeId::new("n1"));
    assert_eq!(b.get(), Some(NodeId::new("n1")));
    b.set(NodeId::new("n2"));
    assert_eq!(a.get(), Some(NodeId::new("n2")));
    // an unrelated slot stays empty
    assert_eq!(NodeSlot::new().get(), None);
}

#[test]
fn a_fault_runs_the_hook_once_whenever_it_was_set() {
    use std::sync::atomic::AtomicU32;
    let runs = Arc::new(AtomicU32::new(0));
    let slot = NodeSlot::new();
    let r = runs.clone();
    slot.on_node_fault(move |fault| {
        assert_eq!(fault, NodeFault::Broke);
        r.fetch_add(1, Ordering::SeqCst);
    });
    assert!(!slot.node_fault_reported());
    slot.clone().report_node_fault();
    slot.report_node_fault();
    assert!(slot.node_fault_reported());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // set after the report: runs at once
    let r = runs.clone();
    slot.on_node_fault(move |_| {
        r.fetch_add(1, Ordering::SeqCst);
    });
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[test]
fn the_first_fault_kind_reported_is_the_one_kept() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let slot = NodeSlot::new();
    let s = seen.clone();
    slot.on_node_fault(move |fault| s.lock().unwrap_or_else(PoisonError::into_inner).push(fault));
    assert_eq!(slot.node_fault(), None);
    slot.report(NodeFault::Stalled);
    slot.report_node_fault();
    assert_eq!(slot.node_fault(), Some(NodeFault::Stalled));
    assert_eq!(
        *seen.lock().unwrap_or_else(PoisonError::into_inner),
        vec![NodeFault::Stalled]
    );
}
