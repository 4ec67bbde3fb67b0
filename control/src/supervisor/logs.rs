//! Per-model ring buffer of log lines, with followers.

use std::collections::VecDeque;
use std::sync::Mutex;
use tokio::sync::broadcast;

/// One line of an engine's output, or one siesta adds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    pub seq: u64,
    pub at_unix_ms: i64,
    /// "stdout", "stderr" or "siesta".
    pub stream: &'static str,
    pub line: String,
}

#[derive(Debug)]
struct Ring {
    lines: VecDeque<LogLine>,
    next_seq: u64,
}

/// The last `cap` lines of one model, and a feed of new ones.
#[derive(Debug)]
pub struct LogRing {
    ring: Mutex<Ring>,
    cap: usize,
    feed: broadcast::Sender<LogLine>,
}

impl LogRing {
    pub fn new(cap: usize) -> Self {
        Self {
            ring: Mutex::new(Ring {
                lines: VecDeque::new(),
                next_seq: 1,
            }),
            cap: cap.max(1),
            feed: broadcast::channel(1024).0,
        }
    }

    pub fn push(&self, stream: &'static str, line: impl Into<String>) {
        let at_unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0);
        let mut ring = self.ring.lock().unwrap();
        let entry = LogLine {
            seq: ring.next_seq,
            at_unix_ms,
            stream,
            line: line.into(),
        };
        ring.next_seq += 1;
        if ring.lines.len() == self.cap {
            ring.lines.pop_front();
        }
        ring.lines.push_back(entry.clone());
        // Sent under the lock so followers see lines in order, none twice.
        let _ = self.feed.send(entry);
    }

    /// The last `n` lines (None: all kept) and, atomically, a feed of
    /// later ones.
    pub fn tail(&self, n: Option<usize>) -> (Vec<LogLine>, broadcast::Receiver<LogLine>) {
        let ring = self.ring.lock().unwrap();
        let skip = n.map_or(0, |n| ring.lines.len().saturating_sub(n));
        (
            ring.lines.iter().skip(skip).cloned().collect(),
            self.feed.subscribe(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn ring_keeps_the_last_lines_and_feeds_new_ones() {
        let ring = LogRing::new(3);
        for i in 0..5 {
            ring.push("stdout", format!("line {i}"));
        }
        let (lines, mut feed) = ring.tail(Some(2));
        assert_eq!(lines.iter().map(|l| l.seq).collect::<Vec<_>>(), [4, 5]);
        assert_eq!(ring.tail(None).0.len(), 3);
        assert_eq!(ring.tail(Some(0)).0.len(), 0);
        ring.push("siesta", "new");
        assert_eq!(feed.recv().await.unwrap().seq, 6);
    }
}
