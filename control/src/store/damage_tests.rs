//! A store file found damaged at open (truncated, emptied, or one redb
//! panics on) is moved aside and reported, as a corrupt one is: never a panic, never a silent reset.

use super::tests::intent;
use super::*;

/// What `f` logs (as the daemon's log would show it), and what it returns.
fn logged<T>(f: impl FnOnce() -> T) -> (T, String) {
    #[derive(Clone, Default)]
    struct Buf(Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer({
            let buf = buf.clone();
            move || buf.clone()
        })
        .with_ansi(false)
        .finish();
    let out = tracing::subscriber::with_default(subscriber, f);
    let text = String::from_utf8_lossy(&buf.0.lock().unwrap()).into_owned();
    (out, text)
}

/// A store with an intent in it, closed; its file's path and length.
fn a_written_store(dir: &Path) -> (PathBuf, u64) {
    let s = Store::open(dir).unwrap();
    for i in 0..50 {
        assert!(s.set(&format!("m{i}"), intent(i)));
    }
    drop(s);
    let path = dir.join(FILE_NAME);
    let len = std::fs::metadata(&path).unwrap().len();
    (path, len)
}

/// `Store::open` of `dir` moves its store aside as corrupt, logs an error
/// naming the file, and starts a fresh store; the bytes moved aside are
/// `before`'s.
fn moved_aside_as_corrupt(dir: &Path, before: &[u8]) -> String {
    let path = dir.join(FILE_NAME);
    let (s, log) = logged(|| Store::open(dir));
    let s = s.unwrap_or_else(|e| panic!("open refused: {e}"));
    let aside = s.moved_aside().expect("moved aside").to_path_buf();
    let name = aside.file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("siesta.redb.corrupt-"), "{name}");
    assert_eq!(std::fs::read(&aside).unwrap(), before, "kept as it was");
    assert!(log.contains("ERROR"), "{log}");
    assert!(log.contains(&*path.to_string_lossy()), "{log}");
    assert!(log.contains(&name), "{log}");
    assert_eq!(s.get("m1"), None, "a fresh store");
    assert!(s.set("m1", intent(7)), "the fresh store writes");
    log
}

/// A truncated store file (a copy cut short, a disk that lost its tail)
/// is moved aside as corrupt, named in the log: redb asserted on it
/// (`raw_file_len() >= header.layout().len()`), which panicked the daemon
/// at every start.
#[test]
fn a_truncated_store_is_moved_aside_not_a_panic() {
    for cut in [4096, 0] {
        let dir = tempfile::tempdir().unwrap();
        let (path, len) = a_written_store(dir.path());
        let keep = if cut == 0 { len / 2 } else { len - cut };
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.set_len(keep).unwrap();
        drop(file);
        let before = std::fs::read(&path).unwrap();
        let log = moved_aside_as_corrupt(dir.path(), &before);
        assert!(log.contains("truncated"), "{log}");
    }
}

/// A store whose header redb asserts on (here a page size other than
/// redb's) is moved aside as corrupt: the panic inside redb's open is
/// caught, and the daemon starts.
#[test]
fn a_store_redb_panics_on_is_moved_aside() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = a_written_store(dir.path());
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[12..16].copy_from_slice(&2048u32.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let log = moved_aside_as_corrupt(dir.path(), &bytes);
    assert!(log.contains("redb failed an assertion"), "{log}");
}

/// An empty store file (a file system that lost its data, a copy that
/// failed) is moved aside and reported, not taken for a new store: every
/// intent in it was lost without a word.
#[test]
fn an_empty_store_file_is_reported_not_taken_for_a_new_store() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = a_written_store(dir.path());
    std::fs::write(&path, b"").unwrap();
    let log = moved_aside_as_corrupt(dir.path(), b"");
    assert!(log.contains("empty"), "{log}");
}
