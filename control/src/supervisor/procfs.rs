//! What `/proc` says about a process: its start time (to tell a reused pid
//! apart), whether it lives, and which process carries an engine tag.

/// Fields of `/proc/PID/stat` after the command name.
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let close = text.rfind(')')?;
    Some(
        text.get(close + 1..)?
            .split_whitespace()
            .map(str::to_string)
            .collect(),
    )
}

/// `/proc/PID/stat` field 22: start time in clock ticks after boot.
pub fn start_time(pid: u32) -> Option<u64> {
    // Field 3 (state) is index 0 after the command name; field 22 is index 19.
    stat_fields(pid)?.get(19)?.parse().ok()
}

/// Whether `pid` runs (not a zombie) and, when `start_time` is given,
/// started then (the same process, not a reused pid).
pub fn alive(pid: u32, start: Option<u64>) -> bool {
    let Some(f) = stat_fields(pid) else {
        return false;
    };
    let running = f.first().is_some_and(|s| s != "Z" && s != "X");
    running && start.is_none_or(|t| f.get(19).and_then(|v| v.parse().ok()) == Some(t))
}

/// Process group of `pid`.
pub fn pgid(pid: u32) -> Option<u32> {
    stat_fields(pid)?.get(2)?.parse().ok()
}

/// Live members of process group `pgid` (its leader included, if alive).
pub fn group_members(pgid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| pgid_of_live(*pid) == Some(pgid))
        .collect()
}

/// Process group of `pid` if it runs (not a zombie).
fn pgid_of_live(pid: u32) -> Option<u32> {
    let f = stat_fields(pid)?;
    if f.first().is_none_or(|s| s == "Z" || s == "X") {
        return None;
    }
    f.get(2)?.parse().ok()
}

/// Live processes whose environment holds `key=value` (our own processes'
/// environments are readable).
pub fn pids_with_env(key: &str, value: &str) -> Vec<u32> {
    let needle = format!("{key}={value}");
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()))
        })
        .filter(|pid| alive(*pid, None))
        .collect()
}

/// The value of `key` in the environment `pid` started with.
pub fn env_value(pid: u32, key: &str) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let prefix = format!("{key}=");
    env.split(|b| *b == 0)
        .find_map(|kv| kv.strip_prefix(prefix.as_bytes()))
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

/// Whether `pid`'s environment holds `key=value`; None when it cannot be
/// read (the process is gone, or another user's).
pub fn carries_env(pid: u32, key: &str, value: &str) -> Option<bool> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let needle = format!("{key}={value}");
    Some(env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_has_a_stable_start_time() {
        let me = std::process::id();
        let t = start_time(me).unwrap();
        assert!(alive(me, Some(t)));
        assert!(!alive(me, Some(t + 1)));
        assert!(pgid(me).is_some());
    }

    #[test]
    fn finds_a_process_by_its_tag() {
        let tag = format!("procfs-{}", std::process::id());
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .env("SIESTA_ENGINE_TAG", &tag)
            .spawn()
            .unwrap();
        // The new environment shows in /proc a moment after the spawn returns.
        let mut found = Vec::new();
        for _ in 0..250 {
            found = pids_with_env("SIESTA_ENGINE_TAG", &tag);
            if !found.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let value = env_value(child.id(), "SIESTA_ENGINE_TAG");
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(found, vec![child.id()]);
        assert_eq!(value.as_deref(), Some(tag.as_str()));
        assert!(!alive(child.id(), None));
    }
}
