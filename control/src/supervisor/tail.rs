//! An engine's output files: opened for appending, followed line by line
//! into the log ring, and kept to [`ENGINE_LOG_MAX`] each.
//!
//! A long-lived vLLM engine writes an access-log line for every probe
//! (`/health` every second, `/metrics` and `/is_sleeping` while awake):
//! hundreds of MB a month, next to the state store, which fails to record
//! a spawn once the disk is full. A file past the limit is copied to
//! `FILE.1` (the one before it is replaced) and emptied. The engine
//! writes with `O_APPEND`, so its next line lands at the new end rather
//! than at its old offset past a hole.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::LogRing;

/// Largest size of one engine output file before it is rotated.
pub const ENGINE_LOG_MAX: u64 = 64 << 20;

/// `path` emptied (or made), opened for appending: the engine's stdout or
/// stderr.
pub fn fresh_log(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::File::create(path)?;
    std::fs::OpenOptions::new().append(true).open(path)
}

/// Whether `pid` writes to its file descriptor `fd` with `O_APPEND` (an
/// adopted engine spawned by an older siesta did not: emptying its file
/// under it would leave a hole as long as the file was).
pub fn appends(pid: u32, fd: u32) -> bool {
    const O_APPEND: u32 = 0o2000;
    std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("flags:"))
                .and_then(|f| u32::from_str_radix(f.trim(), 8).ok())
        })
        .is_some_and(|f| f & O_APPEND != 0)
}

/// Follows a log file line by line from byte `from` into the ring buffer
/// until the process has exited. With `max`, a file grown past it is
/// rotated (see the module docs).
pub(crate) async fn tail(
    path: PathBuf,
    from: u64,
    stream: &'static str,
    model: String,
    logs: Arc<LogRing>,
    exited: watch::Receiver<bool>,
    max: Option<u64>,
) {
    let Ok(mut file) = std::fs::File::open(&path) else {
        return;
    };
    let mut pos = from;
    let mut partial = Vec::new();
    // After a failed rotation, the next try waits for this size.
    let mut retry_at = 0;
    let mut read_to = |file: &mut std::fs::File, pos: &mut u64, end: Option<u64>| {
        let mut buf = Vec::new();
        if file.seek(SeekFrom::Start(*pos)).is_err() {
            return;
        }
        let read = match end {
            Some(end) => file.take(end.saturating_sub(*pos)).read_to_end(&mut buf),
            None => file.read_to_end(&mut buf),
        };
        let Ok(n) = read else { return };
        *pos += n as u64;
        partial.extend_from_slice(&buf);
        while let Some(i) = partial.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = partial.drain(..=i).collect();
            let text = String::from_utf8_lossy(&line[..line.len() - 1])
                .trim_end()
                .to_string();
            // Engine output lives in its files and `siesta logs`; repeating it
            // (a /health access line every second) would flood the daemon's log.
            // `RUST_LOG=info,siesta::engine=trace` shows it anyway.
            tracing::trace!(target: "siesta::engine", model = %model, stream, "{text}");
            logs.push(stream, text);
        }
    };
    loop {
        let done = *exited.borrow();
        read_to(&mut file, &mut pos, None);
        if let Some(max) = max
            && pos > max.max(retry_at)
            && !done
        {
            match rotate(&path) {
                Ok(copied) => {
                    // Written between the read and the copy: in `.1`, and
                    // into the ring too.
                    read_to(&mut file, &mut pos, Some(copied));
                    tracing::info!(model = %model, stream, file = %path.display(), max, "engine log rotated");
                    pos = 0;
                }
                Err(e) => {
                    // Not again at once (a full disk would be written to
                    // ten times a second): once it has grown an eighth more.
                    retry_at = pos + max / 8;
                    tracing::warn!(model = %model, stream, file = %path.display(), error = %e, "cannot empty the engine log; it grows on");
                }
            }
        }
        if done {
            if !partial.is_empty() {
                logs.push(stream, String::from_utf8_lossy(&partial).to_string());
            }
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `path` copied to `path.1`, then emptied; how much was copied. A copy
/// that fails (a full disk) is given up, `.1` removed: the file is emptied
/// all the same, its old lines lost rather than the disk filled.
fn rotate(path: &Path) -> std::io::Result<u64> {
    let mut old = path.as_os_str().to_owned();
    old.push(".1");
    let old = PathBuf::from(old);
    let copied = std::fs::copy(path, &old).unwrap_or_else(|e| {
        tracing::warn!(file = %path.display(), error = %e, "cannot keep the engine log's earlier part; emptied without it");
        let _ = std::fs::remove_file(&old);
        0
    });
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)?
        .set_len(0)?;
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    /// A writer appending to its file past the limit: the file is rotated
    /// (kept small, the part before in `.1`), no hole is left where the
    /// writer was, and every line reaches the ring.
    #[tokio::test]
    async fn an_engine_log_past_its_limit_is_rotated_without_a_hole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.stdout.log");
        let mut w = fresh_log(&path).unwrap();
        let logs = Arc::new(LogRing::new(100_000));
        let (done_tx, done) = watch::channel(false);
        let task = tokio::spawn(tail(
            path.clone(),
            0,
            "stdout",
            "m".into(),
            logs.clone(),
            done,
            Some(4096),
        ));
        let line = |i: usize| format!("line {i:05} {}\n", "x".repeat(90));
        let mut rotated = false;
        for i in 0..400 {
            w.write_all(line(i).as_bytes()).unwrap();
            if i % 20 == 19 {
                // Let the tail keep up, as an engine's pace lets it.
                tokio::time::sleep(Duration::from_millis(150)).await;
                rotated |= std::fs::metadata(dir.path().join("m.stdout.log.1")).is_ok();
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        done_tx.send(true).unwrap();
        task.await.unwrap();
        assert!(rotated, "never rotated");
        let now = std::fs::read(&path).unwrap();
        assert!(now.len() < 4096 + 20 * 101, "{} bytes", now.len());
        assert!(!now.contains(&0), "a hole where the writer was");
        assert!(now.ends_with(line(399).as_bytes()));
        let (lines, _) = logs.tail(None);
        assert_eq!(lines.len(), 400, "every line in the ring");
        assert!(lines.last().unwrap().line.starts_with("line 00399"));
    }

    #[test]
    fn an_append_only_descriptor_is_told_apart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let _plain = std::fs::File::create(&path).unwrap();
        let _append = fresh_log(&path).unwrap();
        let me = std::process::id();
        let fds: Vec<(u32, bool)> = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| {
                let e = e.ok()?;
                let fd: u32 = e.file_name().to_str()?.parse().ok()?;
                (std::fs::read_link(e.path()).ok()? == path).then(|| (fd, appends(me, fd)))
            })
            .collect();
        assert_eq!(fds.len(), 2, "{fds:?}");
        assert_eq!(fds.iter().filter(|(_, a)| *a).count(), 1, "{fds:?}");
    }
}
