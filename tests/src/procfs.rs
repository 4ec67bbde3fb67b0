//! Process liveness from `/proc`, for asserting that nothing outlives what it should.

/// The fields of `/proc/PID/stat` the tests need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcStat {
    /// The process id.
    pub pid: i32,
    /// The command name (`comm`).
    pub comm: String,
    /// The state letter (`R`, `S`, `Z`, ...).
    pub state: char,
    /// The parent's pid.
    pub ppid: i32,
    /// The process group id.
    pub pgrp: i32,
}

/// Reads `/proc/PID/stat`; `None` when the process does not exist.
pub fn proc_stat(pid: i32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(pid, &text)
}

fn parse_stat(pid: i32, text: &str) -> Option<ProcStat> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text.get(open + 1..close)?.to_string();
    let mut rest = text.get(close + 1..)?.split_whitespace();
    let state = rest.next()?.chars().next()?;
    let ppid = rest.next()?.parse().ok()?;
    let pgrp = rest.next()?.parse().ok()?;
    Some(ProcStat {
        pid,
        comm,
        state,
        ppid,
        pgrp,
    })
}

/// Whether `pid` exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    proc_stat(pid).is_some_and(|s| s.state != 'Z' && s.state != 'X')
}

/// The pids among `pids` that are still alive.
pub fn any_alive(pids: &[i32]) -> Vec<i32> {
    pids.iter().copied().filter(|&p| alive(p)).collect()
}

fn all_live() -> Vec<ProcStat> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(proc_stat)
        .filter(|s| s.state != 'Z' && s.state != 'X')
        .collect()
}

/// Live processes whose process group is `pgid`.
pub fn group_members(pgid: i32) -> Vec<i32> {
    all_live()
        .into_iter()
        .filter(|s| s.pgrp == pgid)
        .map(|s| s.pid)
        .collect()
}

/// Live descendants of `pid` (not including `pid`).
pub fn descendants(pid: i32) -> Vec<i32> {
    let procs = all_live();
    let mut out = Vec::new();
    let mut frontier = vec![pid];
    while let Some(p) = frontier.pop() {
        for s in procs.iter().filter(|s| s.ppid == p) {
            if !out.contains(&s.pid) {
                out.push(s.pid);
                frontier.push(s.pid);
            }
        }
    }
    out
}

/// Live processes whose environment holds `key=value` (readable for our own processes).
pub fn pids_with_env(key: &str, value: &str) -> Vec<i32> {
    let needle = format!("{key}={value}");
    all_live()
        .into_iter()
        .filter(|s| {
            std::fs::read(format!("/proc/{}/environ", s.pid))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()))
        })
        .map(|s| s.pid)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_comm_with_spaces_and_parens() {
        let s = parse_stat(42, "42 (a (b) c) S 7 42 42 0 -1").unwrap();
        assert_eq!(s.comm, "a (b) c");
        assert_eq!((s.state, s.ppid, s.pgrp), ('S', 7, 42));
    }

    #[test]
    fn self_is_alive_and_in_a_group() {
        let me = std::process::id() as i32;
        assert!(alive(me));
        let st = proc_stat(me).unwrap();
        assert!(group_members(st.pgrp).contains(&me));
    }

    #[test]
    fn finds_processes_by_environment() {
        let tag = format!("t{}", std::process::id());
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .env("SIESTA_TEST_PROCFS", &tag)
            .spawn()
            .unwrap();
        // The new environment shows in /proc a moment after the spawn returns.
        let mut found = Vec::new();
        for _ in 0..250 {
            found = pids_with_env("SIESTA_TEST_PROCFS", &tag);
            if !found.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(found, vec![child.id() as i32]);
    }
}
