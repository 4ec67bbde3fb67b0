//! `siesta top`: a full-screen live view for an SSH session on the GPU box.
//! Models and events come pushed from `Watch` (resumed by revision after a
//! reconnect; a restarted control plane gives a fresh snapshot), GPU memory
//! per engine from `ListGpus` every two seconds. The terminal is restored on
//! `q`, Ctrl-C, SIGTERM and on panic.

mod draw;
mod state;

use std::time::Duration;

use ratatui::crossterm::event::{self, Event, KeyEventKind};
use siesta_proto::patience::Patience;
use siesta_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;

use super::watch;
use crate::client::{Conn, RPC_TIMEOUT};
use crate::failure::Failure;
use crate::render::now_ms;
use state::{Action, Link, Top};

/// How often GPU memory is read.
const GPU_EVERY: Duration = Duration::from_secs(2);
/// Reconnection waits, doubling.
const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Engine log lines shown by `l`.
const LOG_TAIL: u32 = 200;

/// What the loop reacts to.
#[derive(Debug)]
enum Feed {
    Event(Box<pb::WatchEvent>),
    Live,
    Lost(String),
    Gpus(pb::ListGpusResponse),
    Key(event::KeyEvent),
    Redraw,
    Message(String),
    EngineLog(String, Vec<String>),
}

pub async fn run(conn: Conn) -> Result<(), Failure> {
    let mut signal = Box::pin(
        siesta_signal::shutdown_signal()
            .map_err(|e| Failure::Failed(format!("installing signal handlers: {e}")))?,
    );
    let (tx, mut rx) = mpsc::channel::<Feed>(1024);
    tokio::spawn(watch_feed(conn.clone(), tx.clone()));
    tokio::spawn(gpu_feed(conn.clone(), tx.clone()));
    // Raw mode, the alternate screen, and a panic hook that restores both.
    let mut terminal = ratatui::try_init()
        .map_err(|e| Failure::Failed(format!("siesta top needs a terminal: {e}")))?;
    let keys = tx.clone();
    std::thread::spawn(move || {
        loop {
            let feed = match event::read() {
                Ok(Event::Key(k)) if k.kind != KeyEventKind::Release => Feed::Key(k),
                Ok(_) => Feed::Redraw,
                Err(_) => return,
            };
            if keys.blocking_send(feed).is_err() {
                return;
            }
        }
    });
    let mut top = Top::new(&conn.url);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let result = loop {
        if let Err(e) = terminal.draw(|f| draw::draw(f, &top, now_ms())) {
            break Err(Failure::Failed(format!("drawing: {e}")));
        }
        let feed = tokio::select! {
            _ = &mut signal => break Ok(()),
            _ = tick.tick() => continue,
            feed = rx.recv() => feed,
        };
        let Some(feed) = feed else { break Ok(()) };
        match feed {
            Feed::Event(ev) => {
                top.link = Link::Live;
                top.apply(&ev);
            }
            Feed::Live => top.link = Link::Live,
            Feed::Lost(why) => {
                if !matches!(top.link, Link::Reconnecting(_)) {
                    top.note(now_ms(), format!("lost the control plane: {why}"));
                }
                top.link = Link::Reconnecting(why);
            }
            Feed::Gpus(g) => top.gpus = Some(g),
            Feed::Redraw => {}
            Feed::Message(m) => {
                top.note(now_ms(), &m);
                top.message = m;
            }
            Feed::EngineLog(name, lines) => top.engine_log = Some((name, lines)),
            Feed::Key(k) => match top.key(k) {
                None => {}
                Some(Action::Quit) => break Ok(()),
                Some(a) => {
                    top.message = "…".into();
                    tokio::spawn(act(conn.clone(), a, tx.clone()));
                }
            },
        }
    };
    ratatui::restore();
    result
}

/// Carries out an operation; its answer comes back as a message.
async fn act(conn: Conn, action: Action, tx: mpsc::Sender<Feed>) {
    let mut c = conn.client.clone();
    let (what, name) = match &action {
        Action::Wake(n) => ("wake", n.clone()),
        Action::Sleep(n, 1) => ("sleep l1", n.clone()),
        Action::Sleep(n, _) => ("sleep l2", n.clone()),
        Action::Pin(n) => ("pin", n.clone()),
        Action::Unpin(n) => ("unpin", n.clone()),
        Action::Stop(n) => ("stop", n.clone()),
        Action::Logs(n) => ("logs", n.clone()),
        Action::Quit => return,
    };
    let call = async {
        let model = || pb::ModelRequest { name: name.clone() };
        let reply = match action {
            Action::Wake(_) => {
                c.wake(pb::WakeRequest {
                    name: name.clone(),
                    wait: false,
                    timeout_ms: 0,
                })
                .await
            }
            Action::Sleep(_, level) => {
                c.sleep(pb::SleepRequest {
                    name: name.clone(),
                    level,
                })
                .await
            }
            Action::Pin(_) => {
                c.pin(pb::PinRequest {
                    name: name.clone(),
                    until_unix_ms: 0,
                    for_ms: 0,
                })
                .await
            }
            Action::Unpin(_) => c.unpin(model()).await,
            Action::Stop(_) => c.stop(model()).await,
            Action::Logs(_) => {
                let mut s = c
                    .logs(pb::LogsRequest {
                        name: name.clone(),
                        tail: Some(LOG_TAIL),
                        follow: false,
                    })
                    .await?
                    .into_inner();
                let mut lines = Vec::new();
                while let Some(l) = s.next().await {
                    let l = l?;
                    lines.push(format!(
                        "{} {} {}",
                        state::clock(l.at_unix_ms),
                        l.stream,
                        l.line
                    ));
                }
                let _ = tx.send(Feed::EngineLog(name.clone(), lines)).await;
                return Ok(None);
            }
            Action::Quit => return Ok(None),
        };
        reply.map(|r| Some(r.into_inner().message))
    };
    let msg = match tokio::time::timeout(RPC_TIMEOUT, call).await {
        Ok(Ok(None)) => return,
        Ok(Ok(Some(m))) => format!("{what} {name}: {m}"),
        Ok(Err(s)) => format!("{what} {name} refused: {}", s.message()),
        Err(_) => format!("{what} {name}: no answer within {RPC_TIMEOUT:?}"),
    };
    let _ = tx.send(Feed::Message(msg)).await;
}

/// Follows `Watch`, reconnecting with capped backoff and resuming after the
/// last revision; another run of the control plane starts from a snapshot.
async fn watch_feed(conn: Conn, tx: mpsc::Sender<Feed>) {
    let mut since = 0;
    let mut incarnation: Option<watch::Incarnation> = None;
    let mut backoff = BACKOFF_MIN;
    loop {
        let why = match watch::incarnation_now(&conn).await {
            Err(s) => s.message().to_string(),
            Ok((now, revision)) => {
                if incarnation.as_ref() != Some(&now) || revision < since {
                    since = 0;
                }
                let of = incarnation.insert(now);
                match watch::open(&conn, since, of, "siesta top").await {
                    Err(s) => s.message().to_string(),
                    Ok(mut events) => {
                        if tx.send(Feed::Live).await.is_err() {
                            return;
                        }
                        let mut patience = Patience::default();
                        loop {
                            let next = match patience.within(events.next()).await {
                                Ok(next) => next,
                                Err(why) => break why,
                            };
                            match next {
                                Some(Ok(ev)) if patience.heard(&ev) => {}
                                Some(Ok(ev)) => {
                                    backoff = BACKOFF_MIN;
                                    since = ev.revision;
                                    if tx.send(Feed::Event(Box::new(ev))).await.is_err() {
                                        return;
                                    }
                                }
                                Some(Err(s)) => break s.message().to_string(),
                                None => break "the control plane ended the stream".to_string(),
                            }
                        }
                    }
                }
            }
        };
        if tx.send(Feed::Lost(why)).await.is_err() {
            return;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// GPU memory per engine, read every [`GPU_EVERY`] (NVML per process).
async fn gpu_feed(conn: Conn, tx: mpsc::Sender<Feed>) {
    let mut every = tokio::time::interval(GPU_EVERY);
    loop {
        every.tick().await;
        let mut c = conn.client.clone();
        let reply = tokio::time::timeout(RPC_TIMEOUT, c.list_gpus(pb::ListGpusRequest::default()));
        if let Ok(Ok(r)) = reply.await
            && tx.send(Feed::Gpus(r.into_inner())).await.is_err()
        {
            return;
        }
    }
}
