//! A store whose disk is full (ENOSPC) for a moment or for a while: what
//! failed is written once there is room, and reads meanwhile give the
//! latest record of every key.

use super::tests::{engine, intent};
use super::*;
use std::time::Duration;

/// How long a test waits for the writer to get a failed write through
/// once there is room (it tries every second).
const WRITTEN_WITHIN: Duration = Duration::from_secs(30);

/// A disk full for one write (ENOSPC) loses nothing: the round is tried
/// again on the reopened file. Full for a while: the writes of that time
/// fail and say so, and once there is room again the store writes as
/// before, those failed writes included. redb
/// refuses every write after an I/O error until the file is reopened
/// ("Previous I/O error occurred"): without the reopen, no engine could
/// be recorded, so none started, until siesta-control was restarted.
#[test]
fn a_store_that_could_not_write_for_a_while_writes_again() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(dir.path()).unwrap();
    assert!(s.set_engine("a", &engine(1, 1)));
    let file = dir.path().join(FILE_NAME);
    // Full for one write: the round is tried again on the reopened file,
    // and nothing is lost.
    faults::fail_next_write(&file);
    assert!(
        s.set_engine("e", &engine(5, 1)),
        "lost to a moment's full disk"
    );
    faults::disk_full(&file, true);
    assert!(!s.set_engine("b", &engine(2, 1)), "written on a full disk");
    assert!(!s.set("c", intent(3)), "written on a full disk");
    // Read while the disk is full, the file closed by a reopen that failed.
    assert!(
        !s.db.is_open(),
        "the reopen did not fail: nothing is tested"
    );
    assert_eq!(s.engine("a"), Some(engine(1, 1)));
    faults::disk_full(&file, false);
    assert!(
        s.set_engine("d", &engine(4, 1)),
        "not written once there is room"
    );
    assert!(s.set("c", intent(3)));
    assert_eq!(s.engine("a"), Some(engine(1, 1)));
    assert_eq!(s.engine("d"), Some(engine(4, 1)));
    drop(s);
    let s = Store::open(dir.path()).unwrap();
    assert!(s.moved_aside().is_none());
    assert_eq!(s.engine("a"), Some(engine(1, 1)));
    assert_eq!(s.engine("b"), Some(engine(2, 1)), "a failed write is kept");
    assert_eq!(s.engine("d"), Some(engine(4, 1)));
    assert_eq!(s.engine("e"), Some(engine(5, 1)));
    assert_eq!(s.get("c"), Some(intent(3)));
}

/// An intent whose write failed on a full disk (an operator's `sleep`,
/// told "failed" in the model's log) is written once the disk has room,
/// though nothing is written after it: before, the file kept the intent
/// from before until the model wrote again, and a control restarted
/// meanwhile woke the engine by that stale intent. Of several failed
/// writes of one key the newest is the one kept and written.
#[test]
fn a_write_that_failed_is_written_once_there_is_room_without_another_write() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(dir.path()).unwrap();
    assert!(s.set("x", intent(1)));
    assert!(s.set("y", intent(1)));
    let file = dir.path().join(FILE_NAME);
    faults::disk_full(&file, true);
    assert!(!s.set("x", intent(2)), "written on a full disk");
    assert!(!s.set("x", intent(3)), "written on a full disk");
    assert!(!s.remove("y").wait_blocking(), "written on a full disk");
    assert_eq!(s.writes.queued(), 2, "the newest write of each key kept");
    assert_eq!(s.get("x"), Some(intent(3)), "the latest read back");
    assert_eq!(s.get("y"), None, "the latest read back");
    faults::disk_full(&file, false);
    assert!(
        s.writes.wait_until_written(WRITTEN_WITHIN),
        "the failed writes were not written once there was room"
    );
    // In the file itself, before the store closes (which commits what is
    // queued).
    assert!(s.db.is_open());
    let committed = s.read_committed(INTENTS, "x").expect("x in the file");
    assert_eq!(
        serde_json::from_slice::<IntentRecord>(&committed).unwrap(),
        intent(3)
    );
    assert_eq!(s.read_committed(INTENTS, "y"), None);
    drop(s);
    let s = Store::open(dir.path()).unwrap();
    assert_eq!(s.get("x"), Some(intent(3)));
    assert_eq!(s.get("y"), None);
    assert_eq!(s.intent_names(), ["x"]);
}

/// While the file is closed by a reopen that failed (the disk still
/// full), every read gives the latest record: the one committed before,
/// or the one whose write failed. A read of a committed intent gave None
/// before, and a reload meanwhile started that model from its preload,
/// dropping an operator's stop or pin.
#[test]
fn reads_while_the_disk_is_full_give_the_latest_record_never_none() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(dir.path()).unwrap();
    assert!(s.set("x", intent(1)));
    assert!(s.set_engine("a", &engine(1, 1)));
    let file = dir.path().join(FILE_NAME);
    faults::disk_full(&file, true);
    assert!(!s.set("y", intent(2)), "written on a full disk");
    assert!(!s.set_engine("a", &engine(7, 2)), "written on a full disk");
    assert!(
        !s.db.is_open(),
        "the reopen did not fail: nothing is tested"
    );
    assert_eq!(s.get("x"), Some(intent(1)), "committed before");
    assert_eq!(s.get("y"), Some(intent(2)), "its write failed");
    assert_eq!(s.engine("a"), Some(engine(7, 2)), "its write failed");
    assert_eq!(s.intent_names(), ["x", "y"]);
    assert_eq!(s.engines(), vec![("a".to_string(), engine(7, 2))]);
    // An engine's exit that removes its own record sees the latest one.
    s.remove_engine("a", "t-of-another-engine");
    assert_eq!(s.engine("a"), Some(engine(7, 2)));
    faults::disk_full(&file, false);
    assert!(s.writes.wait_until_written(WRITTEN_WITHIN));
    assert_eq!(s.get("x"), Some(intent(1)));
    drop(s);
    let s = Store::open(dir.path()).unwrap();
    assert_eq!(s.get("y"), Some(intent(2)));
    assert_eq!(s.engine("a"), Some(engine(7, 2)));
}
