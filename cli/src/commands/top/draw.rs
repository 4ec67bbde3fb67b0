//! Drawing `siesta top`: header, one bar per GPU split by engine, one row
//! per model, live wakes against their calibrated time, the event log (or
//! the selected engine's log), and the keys.

use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Cell, Paragraph, Row, Table, TableState};
use siesta_proto::v1 as pb;

use super::state::{Link, Top};
use crate::commands::wake::{estimate_ms, progress_line};
use crate::render;

const PALETTE: [Color; 6] = [
    Color::Cyan,
    Color::Magenta,
    Color::Yellow,
    Color::LightGreen,
    Color::LightBlue,
    Color::LightRed,
];

fn model_colour(top: &Top, name: &str) -> Color {
    let i = top.models.keys().position(|k| k == name).unwrap_or(0);
    PALETTE[i % PALETTE.len()]
}

fn state_style(s: pb::ModelState) -> Style {
    let c = match s {
        pb::ModelState::Awake => Color::Green,
        pb::ModelState::Asleep => Color::Blue,
        pb::ModelState::Waking
        | pb::ModelState::Starting
        | pb::ModelState::Sleeping
        | pb::ModelState::Stopping => Color::Yellow,
        pb::ModelState::Failed => Color::Red,
        _ => Color::DarkGray,
    };
    Style::default().fg(c)
}

/// `width` cells: `filled` of them `█`, the rest `░`.
fn bar(frac: f64, width: usize) -> (String, String) {
    let filled = ((frac.clamp(0.0, 1.0)) * width as f64).round() as usize;
    ("█".repeat(filled), "░".repeat(width - filled))
}

pub fn draw(f: &mut Frame, top: &Top, now: i64) {
    let gpu_lines = top.gpus.as_ref().map_or(1, |g| g.gpus.len().max(1)) as u16;
    let waking: Vec<&pb::ModelStatus> = top
        .models
        .values()
        .filter(|m| matches!(m.state(), pb::ModelState::Waking | pb::ModelState::Starting))
        .collect();
    let areas = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(gpu_lines + 2),
        Constraint::Length(top.models.len().max(1) as u16 + 3),
        Constraint::Length(waking.len() as u16),
        Constraint::Min(6),
        Constraint::Length(1),
    ])
    .split(f.area());
    header(f, areas[0], top, now);
    gpus(f, areas[1], top);
    models(f, areas[2], top, now);
    let progress: Vec<Line> = waking
        .iter()
        .map(|m| {
            let elapsed = (now - m.state_since_unix_ms).max(0) as u64;
            Line::styled(
                progress_line(&m.name, &render::state_label(m), elapsed, estimate_ms(m)),
                Style::default().fg(Color::Yellow),
            )
        })
        .collect();
    f.render_widget(Paragraph::new(progress), areas[3]);
    match &top.engine_log {
        Some((name, lines)) => {
            let h = areas[4].height.saturating_sub(2) as usize;
            let shown: Vec<Line> = lines
                .iter()
                .skip(lines.len().saturating_sub(h))
                .map(|l| Line::raw(l.as_str()))
                .collect();
            let block = Block::default()
                .borders(Borders::ALL)
                .title(format!(" engine log: {name} (l or Esc closes) "));
            f.render_widget(Paragraph::new(shown).block(block), areas[4]);
        }
        None => {
            let h = areas[4].height.saturating_sub(2) as usize;
            let shown: Vec<Line> = top
                .log
                .iter()
                .skip(top.log.len().saturating_sub(h))
                .map(|l| Line::raw(l.as_str()))
                .collect();
            let block = Block::default().borders(Borders::ALL).title(" events ");
            f.render_widget(Paragraph::new(shown).block(block), areas[4]);
        }
    }
    let keys = Line::from(vec![
        Span::styled(
            " ↑↓ select  w wake  1/2 sleep  p pin  s stop  l log  q quit ",
            Style::default().add_modifier(Modifier::REVERSED),
        ),
        Span::raw("  "),
        Span::raw(top.message.as_str()),
    ]);
    f.render_widget(Paragraph::new(keys), areas[5]);
}

fn header(f: &mut Frame, area: Rect, top: &Top, now: i64) {
    let (text, style) = match &top.link {
        Link::Live => ("live".to_string(), Style::default().fg(Color::Green)),
        Link::Connecting => (
            "connecting…".to_string(),
            Style::default().fg(Color::Yellow),
        ),
        Link::Reconnecting(why) => (
            format!("reconnecting… ({why})"),
            Style::default().fg(Color::Yellow),
        ),
    };
    let line = Line::from(vec![
        Span::styled("siesta top", Style::default().add_modifier(Modifier::BOLD)),
        Span::raw(format!("  {}  ", top.url)),
        Span::styled(text, style),
        Span::raw(format!(
            "  revision {}  {} UTC",
            top.revision,
            super::state::clock(now)
        )),
    ]);
    f.render_widget(Paragraph::new(line), area);
}

fn gpus(f: &mut Frame, area: Rect, top: &Top) {
    let mut block = Block::default().borders(Borders::ALL).title(" GPUs ");
    // Why they are not a fresh NVML read (NVML absent, failing or silent).
    if let Some(note) = top.gpus.as_ref().map(|g| &g.note).filter(|n| !n.is_empty()) {
        block = block.title(Line::styled(
            format!(" {note} "),
            Style::default().fg(Color::Yellow),
        ));
    }
    let Some(g) = top.gpus.as_ref().filter(|g| !g.gpus.is_empty()) else {
        f.render_widget(Paragraph::new("no GPUs").block(block), area);
        return;
    };
    let width = (area.width as usize).saturating_sub(70).clamp(10, 60);
    let lines: Vec<Line> = g
        .gpus
        .iter()
        .map(|gpu| {
            let total = gpu.memory_total_bytes.max(1) as f64;
            let mut spans = vec![Span::raw(format!("GPU{} ", gpu.index))];
            let mut cells = 0;
            let mut known = 0;
            for p in &gpu.processes {
                known += p.used_bytes;
                let n = ((p.used_bytes as f64 / total) * width as f64).round() as usize;
                let n = n.min(width - cells);
                cells += n;
                let colour = if p.model.is_empty() {
                    Color::DarkGray
                } else {
                    model_colour(top, &p.model)
                };
                spans.push(Span::styled("█".repeat(n), Style::default().fg(colour)));
            }
            let other = gpu.memory_used_bytes.saturating_sub(known);
            let n = (((other as f64 / total) * width as f64).round() as usize).min(width - cells);
            cells += n;
            spans.push(Span::styled(
                "▒".repeat(n),
                Style::default().fg(Color::DarkGray),
            ));
            spans.push(Span::raw("░".repeat(width - cells)));
            let p2p: Vec<String> = g
                .p2p
                .iter()
                .filter(|p| p.src == gpu.index)
                .map(|p| format!("→{} {}", p.dst, render::p2p_name(p.health())))
                .collect();
            spans.push(Span::raw(format!(
                " {} / {}  {}  {}",
                render::bytes(gpu.memory_used_bytes),
                render::bytes(gpu.memory_total_bytes),
                gpu.name,
                p2p.join("  ")
            )));
            Line::from(spans)
        })
        .collect();
    f.render_widget(Paragraph::new(lines).block(block), area);
}

fn models(f: &mut Frame, area: Rect, top: &Top, now: i64) {
    let header = Row::new([
        "MODEL",
        "STATE",
        "GPUS",
        "GPU MEMORY",
        "IN FLIGHT",
        "HELD",
        "NEXT IDLE TIER",
        "LAST ERROR",
    ])
    .style(Style::default().add_modifier(Modifier::BOLD));
    let rows: Vec<Row> = top
        .models
        .values()
        .map(|m| {
            let (used, total) = top.engine_memory(&m.name, &m.gpus);
            let (full, empty) = bar(
                if total > 0 {
                    used as f64 / total as f64
                } else {
                    0.0
                },
                10,
            );
            let mem = Line::from(vec![
                Span::styled(full, Style::default().fg(model_colour(top, &m.name))),
                Span::raw(empty),
                Span::raw(format!(
                    " {}",
                    if used > 0 {
                        render::bytes(used)
                    } else {
                        "-".into()
                    }
                )),
            ]);
            let pin = if m.pinned_until_unix_ms != 0 {
                " [pin]"
            } else {
                ""
            };
            Row::new(vec![
                Cell::from(format!("{}{pin}", m.name)),
                Cell::from(format!(
                    "{} {}",
                    render::state_label(m),
                    render::ago(now, m.state_since_unix_ms)
                ))
                .style(state_style(m.state())),
                Cell::from(render::gpus(&m.gpus)),
                Cell::from(mem),
                Cell::from(m.in_flight.to_string()),
                Cell::from(m.held.to_string()).style(if m.held > 0 {
                    Style::default().fg(Color::Yellow)
                } else {
                    Style::default()
                }),
                Cell::from(render::next_tier(now, m)),
                Cell::from(m.last_error.clone()).style(Style::default().fg(Color::Red)),
            ])
        })
        .collect();
    let table = Table::new(
        rows,
        [
            Constraint::Length(20),
            Constraint::Length(18),
            Constraint::Length(6),
            Constraint::Length(22),
            Constraint::Length(9),
            Constraint::Length(6),
            Constraint::Length(18),
            Constraint::Min(10),
        ],
    )
    .header(header)
    .block(Block::default().borders(Borders::ALL).title(" models "))
    .row_highlight_style(Style::default().add_modifier(Modifier::REVERSED));
    let mut state = TableState::default().with_selected(Some(top.selected));
    f.render_stateful_widget(table, area, &mut state);
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::{Terminal, backend::TestBackend};

    /// The screen's text, row by row.
    fn screen(top: &Top) -> String {
        let mut t = Terminal::new(TestBackend::new(160, 24)).unwrap();
        t.draw(|f| draw(f, top, 0)).unwrap();
        let buf = t.backend().buffer();
        (0..buf.area.height)
            .map(|y| {
                (0..buf.area.width)
                    .map(|x| buf[(x, y)].symbol())
                    .collect::<String>()
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Why the GPUs shown are an older read is on the GPUs' frame; a fresh
    /// read says nothing more.
    #[test]
    fn the_gpus_frame_says_why_they_are_an_older_read() {
        let mut top = Top::new("http://c");
        let mut g = pb::ListGpusResponse {
            source: "nvml".into(),
            gpus: vec![pb::Gpu {
                index: 0,
                name: "H100".into(),
                memory_total_bytes: 80 << 30,
                ..Default::default()
            }],
            ..Default::default()
        };
        top.gpus = Some(g.clone());
        assert!(!screen(&top).contains("NVML"), "{}", screen(&top));
        g.note = "NVML has not answered for 4.0s".into();
        top.gpus = Some(g);
        let s = screen(&top);
        assert!(s.contains("NVML has not answered for 4.0s"), "{s}");
    }
}
