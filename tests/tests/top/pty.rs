//! `siesta top` in a pseudo-terminal, its screen parsed with vt100.
#![allow(dead_code)]

use nix::pty::{Winsize, openpty};
use siesta_tests::bin_path;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Instant;

const ROWS: u16 = 40;
const COLS: u16 = 120;

/// What the pty has shown: the parsed screen, all bytes, and when each
/// state of the watched model first appeared in its row.
pub struct Screen {
    pub parser: vt100::Parser,
    pub raw: Vec<u8>,
    pub first_seen: Vec<(String, Instant)>,
    /// Each value the watched row's HELD cell showed, in order.
    pub held_seen: Vec<String>,
}

pub struct TopPty {
    pub child: tokio::process::Child,
    pub slave: OwnedFd,
    master: std::fs::File,
    pub screen: Arc<Mutex<Screen>>,
}

/// The model's row of the table: its state cell, if on screen.
pub fn row_state(screen: &str, model: &str) -> Option<String> {
    screen.lines().find_map(|l| {
        let cells = l.trim_start_matches(['│', ' ']);
        let rest = cells.strip_prefix(model)?.strip_prefix(' ')?;
        let rest = rest.trim_start();
        let rest = rest.strip_prefix("[pin]").unwrap_or(rest);
        Some(rest.split_whitespace().next()?.to_string())
    })
}

/// The model's row's cell under the header `column` (cells start where
/// their header does), if on screen.
pub fn cell(screen: &str, model: &str, column: &str) -> Option<String> {
    let lines: Vec<Vec<char>> = screen.lines().map(|l| l.chars().collect()).collect();
    let header = lines.iter().find(|l| {
        let s: String = l.iter().collect();
        s.contains("MODEL") && s.contains(column)
    })?;
    let want: Vec<char> = column.chars().collect();
    let at = header
        .windows(want.len())
        .position(|w| w == want.as_slice())?;
    let row = lines.iter().find(|l| {
        let s: String = l.iter().collect();
        let cells = s.trim_start_matches(['│', ' ']);
        cells
            .strip_prefix(model)
            .is_some_and(|r| r.starts_with(' '))
    })?;
    let rest: String = row.get(at..)?.iter().collect();
    rest.split_whitespace().next().map(str::to_string)
}

impl TopPty {
    /// Runs `setsid -c siesta --control URL top` (a session of its own whose
    /// controlling terminal is the pty); notes when `watch`'s row changes.
    pub fn spawn(control_url: &str, watch: &'static str) -> TopPty {
        let size = Winsize {
            ws_row: ROWS,
            ws_col: COLS,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        let pty = openpty(Some(&size), None).expect("openpty");
        let slave = pty.slave;
        let child = tokio::process::Command::new("setsid")
            .arg("-c")
            .arg(bin_path("siesta"))
            .args(["--control", control_url, "top"])
            .env("TERM", "xterm-256color")
            .stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave.try_clone().unwrap()))
            .kill_on_drop(true)
            .spawn()
            .expect("spawning setsid -c siesta top");
        let master = std::fs::File::from(pty.master);
        let mut reader_fd = master.try_clone().unwrap();
        let screen = Arc::new(Mutex::new(Screen {
            parser: vt100::Parser::new(ROWS.try_into().unwrap(), COLS.try_into().unwrap(), 0),
            raw: Vec::new(),
            first_seen: Vec::new(),
            held_seen: Vec::new(),
        }));
        let reader = screen.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 65536];
            while let Ok(n) = reader_fd.read(&mut buf) {
                if n == 0 {
                    return;
                }
                let mut s = reader.lock().unwrap();
                s.parser.process(&buf[..n]);
                s.raw.extend_from_slice(&buf[..n]);
                let text = s.parser.screen().contents();
                if let Some(st) = row_state(&text, watch)
                    && !s.first_seen.iter().any(|(x, _)| *x == st)
                {
                    s.first_seen.push((st, Instant::now()));
                }
                if let Some(h) = cell(&text, watch, "HELD")
                    && s.held_seen.last() != Some(&h)
                {
                    s.held_seen.push(h);
                }
            }
        });
        TopPty {
            child,
            slave,
            master,
            screen,
        }
    }

    /// The screen's text now.
    pub fn text(&self) -> String {
        self.screen.lock().unwrap().parser.screen().contents()
    }

    /// Types keys.
    pub fn keys(&mut self, keys: &[u8]) {
        self.master.write_all(keys).unwrap();
    }

    /// When `state` first showed in the watched row.
    pub fn first_seen(&self, state: &str) -> Option<Instant> {
        let s = self.screen.lock().unwrap();
        s.first_seen
            .iter()
            .find(|(x, _)| x == state)
            .map(|(_, t)| *t)
    }

    /// Off the alternate screen with the cursor shown.
    pub fn restored(&self) -> bool {
        let s = self.screen.lock().unwrap();
        !s.parser.screen().alternate_screen() && !s.parser.screen().hide_cursor()
    }

    /// The values the watched row's HELD cell has shown, in order.
    pub fn held_seen(&self) -> Vec<String> {
        self.screen.lock().unwrap().held_seen.clone()
    }

    pub fn order(&self) -> Vec<String> {
        let s = self.screen.lock().unwrap();
        s.first_seen.iter().map(|(x, _)| x.clone()).collect()
    }
}

#[test]
fn rows_are_found_on_screen() {
    let screen = "│MODEL   STATE\n│alpha [pin]  waking 3s ago\n15:00:00  alpha: asleep → waking\n";
    assert_eq!(row_state(screen, "alpha").as_deref(), Some("waking"));
    assert_eq!(row_state(screen, "alph"), None);
    let screen =
        "│MODEL   STATE   HELD  TIER\n│alpha   waking  12    -\n│beta    awake   0     -\n";
    assert_eq!(cell(screen, "alpha", "HELD").as_deref(), Some("12"));
    assert_eq!(cell(screen, "beta", "HELD").as_deref(), Some("0"));
    assert_eq!(cell(screen, "gamma", "HELD"), None);
}
