//! `siesta wake MODEL [--wait]`: with `--wait`, a live progress line
//! (elapsed against the calibrated estimate) until awake or failed.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use siesta_proto::v1 as pb;
use tokio_stream::StreamExt;

use super::print_operation;
use crate::args::Format;
use crate::client::Conn;
use crate::failure::Failure;
use crate::render;

/// How often the progress line is redrawn on a terminal.
const TICK: Duration = Duration::from_millis(100);
/// How long `wake --wait` waits for its progress Watch to open.
const PROGRESS_OPEN: Duration = Duration::from_secs(10);
/// Width of the progress bar in characters.
const BAR: usize = 24;

pub async fn run(
    conn: Conn,
    name: &str,
    wait: bool,
    timeout: Option<Duration>,
    format: Format,
) -> Result<(), Failure> {
    let req = pb::WakeRequest {
        name: name.to_owned(),
        wait,
        timeout_ms: timeout.map_or(0, |d| d.as_millis() as u64),
    };
    if !wait {
        let resp = conn.call(|mut c| async move { c.wake(req).await }).await?;
        return print_operation(name, &resp, format);
    }
    let initial = conn
        .call(|mut c| async move {
            c.get_model(pb::GetModelRequest {
                name: name.to_owned(),
            })
            .await
        })
        .await?
        .model
        .unwrap_or_default();
    let mode = match format {
        Format::Json => Mode::Quiet,
        Format::Text if std::io::stderr().is_terminal() => Mode::Bar,
        Format::Text => Mode::Lines,
    };
    let mut progress = Progress::new(&initial, mode);

    // Progress comes from Watch; the outcome from the waited Wake call.
    let mut watch_client = conn.client.clone();
    // Progress only: a Watch that does not open within its bound is done
    // without (the wake itself is sent either way).
    let opened = tokio::time::timeout(
        PROGRESS_OPEN,
        watch_client.watch(pb::WatchRequest {
            since_revision: 0,
            client_id: "siesta wake --wait".into(),
            incarnation: 0,
            heartbeat: false,
        }),
    )
    .await;
    let mut events = opened
        .ok()
        .and_then(Result::ok)
        .map(tonic::Response::into_inner);
    let mut wake_client = conn.client.clone();
    let wake = wake_client.wake(req);
    tokio::pin!(wake);
    let mut ticker = tokio::time::interval(TICK);
    let result = loop {
        tokio::select! {
            res = &mut wake => break res,
            ev = next_event(&mut events) => match ev {
                Some(ev) => progress.event(ev),
                None => events = None,
            },
            _ = ticker.tick() => progress.draw(),
        }
    };
    progress.clear();
    let resp = result.map_err(|s| conn.err(s))?.into_inner();
    let model = resp.model.clone().unwrap_or_default();
    let elapsed = progress.started.elapsed().as_millis() as u64;
    if format == Format::Json {
        print_operation(name, &resp, format)?;
    }
    if model.state() == pb::ModelState::Awake {
        if format == Format::Text {
            let est = match progress.estimate_ms {
                0 => String::new(),
                e => format!(" (estimate {})", render::duration(e)),
            };
            println!(
                "{}: awake after {}{est}",
                model.name,
                render::duration(elapsed)
            );
        }
        Ok(())
    } else {
        // The daemon's answer says why the wait ended (failed, called off,
        // timed out); `last_error` may be from before this wake.
        let why = [resp.message.as_str(), model.last_error.as_str()]
            .into_iter()
            .find(|s| !s.is_empty())
            .unwrap_or("no reason given");
        Err(Failure::Failed(format!(
            "{}: not awake after {} (now {}): {why}",
            if model.name.is_empty() {
                name
            } else {
                &model.name
            },
            render::duration(elapsed),
            render::state_label(&model),
        )))
    }
}

async fn next_event(
    events: &mut Option<tonic::Streaming<pb::WatchEvent>>,
) -> Option<pb::WatchEvent> {
    match events {
        Some(s) => s.next().await.and_then(Result::ok),
        None => std::future::pending().await,
    }
}

/// The calibrated time the transition from this state to awake should take.
pub fn estimate_ms(m: &pb::ModelStatus) -> u64 {
    let c = m.calibration.unwrap_or_default();
    match m.state() {
        pb::ModelState::Awake => 0,
        pb::ModelState::Asleep | pb::ModelState::Sleeping | pb::ModelState::Waking => {
            if m.sleep_level == 2 {
                c.wake_l2_ms
            } else {
                c.wake_l1_ms
            }
        }
        _ => c.start_ms,
    }
}

/// The first progress line without a terminal: where the wake starts from.
fn first_line(initial: &pb::ModelStatus) -> String {
    let state = render::state_label(initial);
    if initial.state() == pb::ModelState::Awake {
        return format!("{}: {state} already", initial.name);
    }
    let estimate = match estimate_ms(initial) {
        0 => "no calibrated estimate yet".to_owned(),
        e => format!("usually takes ~{}", render::duration(e)),
    };
    // The status answered is the wake's own (`waking`, `starting`): said
    // as it is ("waking from waking" before).
    match initial.state() {
        pb::ModelState::Waking | pb::ModelState::Starting => {
            format!("{}: {state} ({estimate})", initial.name)
        }
        _ => format!("{}: waking from {state} ({estimate})", initial.name),
    }
}

/// How progress is shown on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// A terminal: one line redrawn in place.
    Bar,
    /// Not a terminal: one line per state change.
    Lines,
    /// `-o json`: nothing.
    Quiet,
}

/// The live progress line, on stderr.
struct Progress {
    name: String,
    state: String,
    estimate_ms: u64,
    started: Instant,
    mode: Mode,
}

impl Progress {
    fn new(initial: &pb::ModelStatus, mode: Mode) -> Self {
        let p = Progress {
            name: initial.name.clone(),
            state: render::state_label(initial),
            estimate_ms: estimate_ms(initial),
            started: Instant::now(),
            mode,
        };
        if p.mode == Mode::Lines {
            eprintln!("{}", first_line(initial));
        }
        p
    }

    fn event(&mut self, ev: pb::WatchEvent) {
        let models = match ev.kind {
            Some(pb::watch_event::Kind::Model(m)) => vec![m],
            Some(pb::watch_event::Kind::Snapshot(s)) => s.models,
            _ => return,
        };
        for m in models.into_iter().filter(|m| m.name == self.name) {
            let state = render::state_label(&m);
            if state != self.state {
                self.state = state;
                self.line_changed();
            }
        }
    }

    /// Without a terminal: one line per state change.
    fn line_changed(&self) {
        if self.mode != Mode::Lines {
            return;
        }
        eprintln!(
            "{}: {} after {}",
            self.name,
            self.state,
            render::duration(self.elapsed_ms())
        );
    }

    fn elapsed_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn draw(&self) {
        if self.mode != Mode::Bar {
            return;
        }
        let line = progress_line(&self.name, &self.state, self.elapsed_ms(), self.estimate_ms);
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r\x1b[2K{line}");
        let _ = err.flush();
    }

    fn clear(&self) {
        if self.mode == Mode::Bar {
            let _ = write!(std::io::stderr().lock(), "\r\x1b[2K");
        }
    }
}

/// `chat: waking  1.4s / ~2.0s  [##########------]  70%`
pub fn progress_line(name: &str, state: &str, elapsed_ms: u64, estimate_ms: u64) -> String {
    let elapsed = render::duration(elapsed_ms);
    if estimate_ms == 0 {
        return format!("{name}: {state}  {elapsed} (no calibrated estimate yet)");
    }
    let frac = (elapsed_ms as f64 / estimate_ms as f64).min(1.0);
    let filled = (frac * BAR as f64).round() as usize;
    let bar: String = "#".repeat(filled) + &"-".repeat(BAR - filled);
    let over = if elapsed_ms > estimate_ms {
        " (taking longer than usual)"
    } else {
        ""
    };
    format!(
        "{name}: {state}  {elapsed} / ~{}  [{bar}] {:>3}%{over}",
        render::duration(estimate_ms),
        (frac * 100.0).round() as u32
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimate_follows_state_and_level() {
        let cal = pb::Calibration {
            start_ms: 9000,
            wake_l1_ms: 1000,
            wake_l2_ms: 4000,
            ..Default::default()
        };
        let mut m = pb::ModelStatus {
            state: pb::ModelState::Asleep as i32,
            sleep_level: 2,
            calibration: Some(cal),
            ..Default::default()
        };
        assert_eq!(estimate_ms(&m), 4000);
        m.sleep_level = 1;
        assert_eq!(estimate_ms(&m), 1000);
        m.state = pb::ModelState::Stopped as i32;
        assert_eq!(estimate_ms(&m), 9000);
    }

    #[test]
    fn the_first_line_does_not_say_waking_for_an_awake_model() {
        let mut m = pb::ModelStatus {
            name: "chat".into(),
            state: pb::ModelState::Awake as i32,
            calibration: Some(pb::Calibration {
                wake_l1_ms: 1500,
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(first_line(&m), "chat: awake already");
        m.state = pb::ModelState::Asleep as i32;
        m.sleep_level = 1;
        assert_eq!(
            first_line(&m),
            "chat: waking from asleep(l1) (usually takes ~1.5s)"
        ); // The wake's own status: said as it is (it read "waking from waking").
        m.state = pb::ModelState::Waking as i32;
        assert_eq!(first_line(&m), "chat: waking (usually takes ~1.5s)");
    }

    #[test]
    fn progress_line_shows_elapsed_against_estimate() {
        let l = progress_line("chat", "waking", 1000, 2000);
        assert_eq!(
            l,
            "chat: waking  1.0s / ~2.0s  [############------------]  50%"
        );
        assert!(
            progress_line("chat", "waking", 3000, 2000).ends_with("(taking longer than usual)")
        );
        assert!(progress_line("chat", "starting", 10, 0).contains("no calibrated estimate"));
    }
}
