//! Configuration: precedence flag > environment > file > default, errors that name the key and
//! its source, and vLLM's config fingerprint (checked against Python's own json + hashlib).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::time::Duration;

use kvpeer::config::{fingerprint, from_env, from_toml, resolve, Settings, KEY, KEYS};
use kvpeer::{NodeConfig, PlaneKind};

fn env(vars: &[(&str, &str)]) -> Settings {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    from_env(|k| map.get(k).cloned())
}

#[test]
fn defaults_apply_when_nothing_is_set() {
    let c = resolve(&Settings::default(), &env(&[]), &Settings::default(), "t").unwrap();
    assert_eq!(c.spec.id.as_str(), "127.0.0.1:0");
    assert_eq!((c.spec.num_blocks, c.spec.block_len), (1024, 65536));
    assert_eq!(c.spec.plane, PlaneKind::Both);
    assert_eq!(c.spec.core.handshake_timeout, Duration::from_secs(30));
    assert_eq!(c.spec.config_fingerprint, "");
    // vLLM's own default seed, so a stock engine with defaults is accepted.
    assert_eq!(c.spec.hash_seed, "vllm-none-hash");
}

/// vLLM advertises PYTHONHASHSEED as its seed when it is set; kvpeer takes it the same way,
/// and the flag still wins.
#[test]
fn the_hash_seed_follows_pythonhashseed_like_vllm() {
    let from_env = resolve(
        &Settings::default(),
        &env(&[("PYTHONHASHSEED", "1234")]),
        &Settings::default(),
        "t",
    )
    .unwrap();
    assert_eq!(from_env.spec.hash_seed, "1234");
    let mut flags = Settings::default();
    flags.set("hash_seed", "7", "flag --hash-seed");
    let flagged = resolve(
        &Settings::default(),
        &env(&[("PYTHONHASHSEED", "1234")]),
        &flags,
        "t",
    )
    .unwrap();
    assert_eq!(flagged.spec.hash_seed, "7");
}

/// vLLM 0.34 reads `VLLM_P2P_TRANSFER_STALL_TIMEOUT_S` as a float, zero or less turning the stall
/// timer off: every value a stock engine takes starts kvpeer too, and the defaults are 0.34's
/// consumer timeouts.
#[test]
fn the_stall_timeout_reads_as_vllm_reads_it_and_the_timeouts_are_0_34s() {
    let stall = |v: &str| {
        let vars = env(&[("VLLM_P2P_TRANSFER_STALL_TIMEOUT_S", v)]);
        resolve(&Settings::default(), &vars, &Settings::default(), "t")
            .map(|c| c.spec.core.transfer_stall_timeout)
    };
    assert_eq!(stall("20").unwrap(), Duration::from_secs(20));
    assert_eq!(stall("20.0").unwrap(), Duration::from_secs(20));
    assert_eq!(stall("0.5").unwrap(), Duration::from_millis(500));
    assert_eq!(stall("0").unwrap(), Duration::ZERO);
    assert_eq!(stall("-1").unwrap(), Duration::ZERO);
    let e = stall("soon").unwrap_err();
    assert_eq!(e.key, "transfer_stall_timeout_s");
    assert_eq!(e.source_name, "env VLLM_P2P_TRANSFER_STALL_TIMEOUT_S");
    let core = resolve(&Settings::default(), &env(&[]), &Settings::default(), "t")
        .unwrap()
        .spec
        .core;
    assert_eq!(
        (
            core.lookup_timeout,
            core.load_timeout,
            core.pd_load_timeout,
            core.abort_ack_timeout,
            core.transfer_stall_timeout
        ),
        (
            Duration::from_secs(8),
            Duration::from_secs(10),
            Duration::from_secs(30),
            Duration::from_secs(5),
            Duration::from_secs(20)
        )
    );
}

#[test]
fn a_flag_beats_the_environment_which_beats_the_file() {
    let file = from_toml(
        "listen_host = \"127.0.0.2\"\nlisten_port = 7000\nmax_peers = 10\nnum_blocks = 64\n\
         handshake_timeout_s = 5\nplane = \"tcp\"\n",
        "kvpeer.toml",
    )
    .unwrap();
    let env = env(&[
        ("VLLM_P2P_SIDE_CHANNEL_PORT", "7100"),
        ("VLLM_P2P_MAX_PEERS", "20"),
        ("VLLM_P2P_HANDSHAKE_TIMEOUT_S", "7"),
    ]);
    let mut flags = Settings::default();
    flags.set("max_peers", "30", "flag --max-peers");
    let c = resolve(&file, &env, &flags, "t").unwrap();
    assert_eq!(
        c.spec.id.as_str(),
        "127.0.0.2:7100",
        "host from file, port from env"
    );
    assert_eq!(c.spec.core.max_peers, 30, "flag over env over file");
    assert_eq!(c.spec.core.handshake_timeout, Duration::from_secs(7));
    assert_eq!(c.spec.num_blocks, 64);
    assert_eq!(c.spec.plane, PlaneKind::Tcp);
}

#[test]
fn errors_name_the_key_and_where_it_came_from() {
    let e = from_toml("num_blokcs = 3\n", "a.toml").unwrap_err();
    assert_eq!(
        (e.key.as_str(), e.problem.as_str()),
        ("num_blokcs", "unknown key; did you mean num_blocks?")
    );
    assert_eq!(e.source_name, "file a.toml");
    // Nothing close: where the keys are listed.
    let e = from_toml("colour = 3\n", "a.toml").unwrap_err();
    assert_eq!(
        e.problem,
        "unknown key (docs/configuration.md lists every key)"
    );

    // A list for a key of one value is refused as a list, whatever its items.
    for list in ["[1]", "[1, 2]", "[\"1\"]"] {
        let e = from_toml(&format!("num_blocks = {list}\n"), "a.toml").unwrap_err();
        assert_eq!(e.key, "num_blocks", "{e}");
        assert!(e.problem.contains("got an array"), "{list}: {e}");
    }

    let e = from_toml("num_blocks = \n", "a.toml").unwrap_err();
    assert_eq!(e.source_name, "file a.toml");

    let bad_env = env(&[("VLLM_P2P_SIDE_CHANNEL_PORT", "seventy")]);
    let e = resolve(&Settings::default(), &bad_env, &Settings::default(), "t").unwrap_err();
    assert_eq!(e.key, "listen_port");
    assert_eq!(e.source_name, "env VLLM_P2P_SIDE_CHANNEL_PORT");
    assert_eq!(
        e.to_string(),
        "env VLLM_P2P_SIDE_CHANNEL_PORT: listen_port: \"seventy\" is not a whole number"
    );

    let file = from_toml("listen_port = 70000\n", "b.toml").unwrap();
    let e = resolve(&file, &env(&[]), &Settings::default(), "t").unwrap_err();
    assert!(
        e.to_string()
            .starts_with("file b.toml: listen_port: 70000 is outside"),
        "{e}"
    );

    let mut flags = Settings::default();
    flags.set("plane", "carrier-pigeon", "flag --plane");
    let e = resolve(&Settings::default(), &env(&[]), &flags, "t").unwrap_err();
    assert_eq!(
        (e.key.as_str(), e.source_name.as_str()),
        ("plane", "flag --plane")
    );

    let file = from_toml("block_len = 0\n", "c.toml").unwrap();
    assert!(resolve(&file, &env(&[]), &Settings::default(), "t").is_err());
}

const FIELDS: &str = r#"{"model_name":"Qwen/Qwen3-0.6B","tokens_per_hash":16,"blocks_per_file":1,"tp_size":1,"pp_size":1,"pcp_size":1,"dcp_size":1,"dtype":"torch.bfloat16","kv_cache_groups":[{"tokens_per_block":16,"layer_names":["model.layers.0.self_attn.attn"]}],"inference_engine":"vllm","note":"café ✓ 𝄞 \"q\" \\ \n"}"#;

#[test]
fn the_fingerprint_is_vllms() {
    let fields: serde_json::Value = serde_json::from_str(FIELDS).unwrap();
    // Computed by Python for these fields (json.dumps(sort_keys=True, separators=(",", ":"))).
    let python = std::env::var("KVPEER_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = std::process::Command::new(python)
        .args([
            "-c",
            "import hashlib, json, sys; f = json.loads(sys.argv[1]); \
             print(hashlib.sha256(json.dumps(f, sort_keys=True, separators=(',', ':')).encode()).hexdigest()[:16])",
            FIELDS,
        ])
        .output()
        .expect("python3 runs");
    let expected = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    assert_eq!(expected.len(), 16, "python said {expected:?}");
    assert_eq!(fingerprint(&fields), expected);
    assert_eq!(
        fingerprint(&serde_json::json!({})),
        "",
        "no fields match anything"
    );
}

#[test]
fn a_fingerprint_table_in_the_file_sets_the_fingerprint() {
    let file = from_toml(
        "[fingerprint_fields]\nmodel_name = \"m\"\ntp_size = 2\n",
        "f.toml",
    )
    .unwrap();
    let c = resolve(&file, &env(&[]), &Settings::default(), "t").unwrap();
    assert_eq!(
        c.spec.config_fingerprint,
        fingerprint(&serde_json::json!({"tp_size": 2, "model_name": "m"}))
    );
    assert_eq!(c.spec.config_fingerprint.len(), 16);
}

#[test]
fn the_allowlist_comes_from_the_file_or_the_flags_and_bad_rules_are_named() {
    let file = from_toml("allowlist = [\"10.0.0.0/8\", \"node-a:5600\"]\n", "a.toml").unwrap();
    let c = resolve(&file, &env(&[]), &Settings::default(), "t").unwrap();
    let peer = |s: &str| kvpeer::PeerId::new(s);
    assert!(c.spec.allowlist.check(&peer("10.1.2.3:9")).is_ok());
    assert!(c.spec.allowlist.check(&peer("node-a:5600")).is_ok());
    assert!(c.spec.allowlist.check(&peer("192.0.2.1:9")).is_err());

    let mut flags = Settings::default();
    flags.set("allowlist", "127.0.0.1", "flag --allow");
    let c = resolve(&file, &env(&[]), &flags, "t").unwrap();
    assert!(
        c.spec.allowlist.check(&peer("10.1.2.3:9")).is_err(),
        "the flag replaces the file"
    );

    let file = from_toml("allowlist = [\"10.0.0.0/40\"]\n", "b.toml").unwrap();
    let e = resolve(&file, &env(&[]), &Settings::default(), "t").unwrap_err();
    assert_eq!(
        (e.key.as_str(), e.source_name.as_str()),
        ("allowlist", "file b.toml")
    );
    assert!(e.problem.contains("10.0.0.0/40"), "{e}");
    // A list key's items are text: a number is no rule (it is not read as an address).
    let e = from_toml("allowlist = [1]\n", "c.toml").unwrap_err();
    assert_eq!(e.key, "allowlist");
    assert!(e.problem.contains("items are strings"), "{e}");
}

#[test]
fn limits_and_the_other_timeouts_are_configurable() {
    let file = from_toml(
        "max_keys_per_message = 64\nmax_message_bytes = 1048576\nabort_ack_timeout_s = 3\n\
         lookup_pending_timeout_s = 2\nunbound_store_timeout_s = 20\npeer_fault_drain_s = 4\n",
        "l.toml",
    )
    .unwrap();
    let c = resolve(&file, &env(&[]), &Settings::default(), "t").unwrap();
    assert_eq!(c.spec.limits.max_list_len, 64);
    assert_eq!(c.spec.limits.max_payload_bytes, 1 << 20);
    assert_eq!(c.spec.control.max_message_bytes, 1 << 20);
    assert_eq!(c.spec.core.abort_ack_timeout, Duration::from_secs(3));
    assert_eq!(c.spec.core.lookup_pending_timeout, Duration::from_secs(2));
    assert_eq!(c.spec.core.unbound_store_timeout, Duration::from_secs(20));
    assert_eq!(c.spec.core.peer_fault_drain, Duration::from_secs(4));
    let file = from_toml("max_message_bytes = 10\n", "m.toml").unwrap();
    let e = resolve(&file, &env(&[]), &Settings::default(), "t").unwrap_err();
    assert_eq!(e.key, "max_message_bytes");
}

/// A file that is not TOML is refused with the line and column of the fault (and the key, when
/// the fault is in a value).
#[test]
fn syntax_errors_name_the_line_and_the_column() {
    let e = from_toml("listen_port = 1\nnum_blocks = \n", "a.toml").unwrap_err();
    assert_eq!(
        (e.source_name.as_str(), e.key.as_str()),
        ("file a.toml", "num_blocks")
    );
    assert!(e.problem.ends_with("(line 2, column 14)"), "{e}");

    let e = from_toml("listen_port = 1\n\nlisten host = 3\n", "b.toml").unwrap_err();
    assert_eq!(e.key, "line 3, column 8", "{e}");
    assert!(
        e.to_string().starts_with("file b.toml: line 3, column 8: "),
        "{e}"
    );
    assert!(!e.to_string().contains('\n'), "one line: {e}");

    let e = from_toml("[[[\n", "c.toml").unwrap_err();
    assert!(e.key.starts_with("line 1, column "), "{e}");

    let e = from_toml("fingerprint_fields = 3\n", "d.toml").unwrap_err();
    assert_eq!(e.key, "fingerprint_fields", "{e}");
    let e = from_toml("num_blocks = [\"1\"]\n", "d.toml").unwrap_err();
    assert_eq!(
        (e.key.as_str(), e.problem.as_str()),
        ("num_blocks", "expected a string or a number, got an array")
    );
}

/// A file may write a value as a string, a number or a boolean; each is checked as text.
#[test]
fn values_may_be_strings_numbers_or_booleans() {
    let file = from_toml(
        "bind_identity = false\nnum_blocks = \"64\"\nlisten_port = 7000\n",
        "v.toml",
    )
    .unwrap();
    let c = resolve(&file, &env(&[]), &Settings::default(), "t").unwrap();
    assert!(!c.spec.bind_identity);
    assert_eq!(c.spec.num_blocks, 64);
    assert_eq!(c.spec.id.as_str(), "127.0.0.1:7000");
    let file = from_toml("bind_identity = 3\n", "v.toml").unwrap();
    let e = resolve(&file, &env(&[]), &Settings::default(), "t").unwrap_err();
    assert_eq!(
        e.to_string(),
        "file v.toml: bind_identity: \"3\" is not true or false"
    );
}

#[test]
fn a_setting_that_is_no_key_is_refused_by_name() {
    let mut flags = Settings::default();
    flags.set("num_blokcs", "3", "flag --x");
    let e = resolve(&Settings::default(), &env(&[]), &flags, "t").unwrap_err();
    assert_eq!(
        e.to_string(),
        "flag --x: num_blokcs: unknown key; did you mean num_blocks?"
    );
}

/// The builder starts from the same defaults as a file and is held to the same bounds.
#[test]
fn the_builder_starts_from_the_declared_defaults_and_checks_bounds() {
    let resolved = resolve(
        &Settings::default(),
        &Settings::default(),
        &Settings::default(),
        "b",
    )
    .unwrap();
    let built = NodeConfig::builder("b").build().unwrap();
    assert_eq!(format!("{:?}", built.spec), format!("{:?}", resolved.spec));
    assert_eq!(built.spec.plane, resolved.spec.plane);
    let local = NodeConfig::local("b");
    assert_eq!(format!("{:?}", local.spec), format!("{:?}", resolved.spec));
    assert_eq!(
        local.spec.num_blocks, 1024,
        "local() has the declared pool size"
    );

    let c = NodeConfig::builder("b")
        .listen("127.0.0.2", 7000)
        .num_blocks(8)
        .block_len(4096)
        .plane(PlaneKind::Shm)
        .hash_seed("7")
        .tcp_max_rate(1000)
        .max_peers(3)
        .allow("10.0.0.0/8")
        .allow("node-a")
        .set("idle_timeout_s", 0)
        .set("tcp_min_rate", 250_000)
        .set("tcp_transfer_timeout_s", 4)
        .build()
        .unwrap();
    assert_eq!(c.spec.id.as_str(), "127.0.0.2:7000");
    assert_eq!((c.spec.num_blocks, c.spec.block_len), (8, 4096));
    assert_eq!(
        (c.spec.plane, c.spec.hash_seed.as_str()),
        (PlaneKind::Shm, "7")
    );
    assert_eq!(c.spec.tcp_max_write_rate, Some(1000));
    assert_eq!(c.spec.tcp_min_write_rate, 250_000);
    assert_eq!(c.spec.tcp_transfer_timeout, Duration::from_secs(4));
    assert_eq!(c.spec.core.max_peers, 3);
    assert_eq!(c.spec.core.idle_timeout, Duration::ZERO);
    let peer = |s: &str| kvpeer::PeerId::new(s);
    assert!(c.spec.allowlist.check(&peer("10.1.2.3:9")).is_ok());
    assert!(c.spec.allowlist.check(&peer("node-a:1")).is_ok());
    assert!(c.spec.allowlist.check(&peer("192.0.2.1:9")).is_err());

    let e = NodeConfig::builder("b").block_len(0).build().unwrap_err();
    assert_eq!(
        (e.source_name.as_str(), e.key.as_str()),
        ("NodeConfig::builder", "block_len")
    );
    let e = NodeConfig::builder("b")
        .set("no_such_key", 1)
        .build()
        .unwrap_err();
    assert_eq!(e.key, "no_such_key");
    let e = NodeConfig::builder("b")
        .allow("10.0.0.0/40")
        .build()
        .unwrap_err();
    assert_eq!(e.key, "allowlist");
}

/// docs/configuration.md lists every key with its default, and every environment variable with
/// its key, as declared (the declaration is the source; the page is held to it).
#[test]
fn the_configuration_page_matches_the_declared_keys() {
    let page = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/configuration.md"
    ))
    .unwrap();
    let keys_table = page
        .split("## Keys")
        .nth(1)
        .unwrap()
        .split("\n## ")
        .next()
        .unwrap();
    let mut documented = Vec::new();
    for row in keys_table.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = row.split(" | ").collect();
        let name = cells[0]
            .trim_start_matches("| ")
            .trim_matches(|c| c == '`' || c == '[' || c == ']');
        let default_cell = cells.last().unwrap().trim_end_matches(" |");
        documented.push(name.to_owned());
        if name == "fingerprint_fields" {
            continue;
        }
        let key = KEYS
            .iter()
            .find(|k| k.name == name)
            .unwrap_or_else(|| panic!("the page documents {name}, which is no key"));
        if let Some(default) = key.default {
            let quoted = format!("`{default}`");
            let string = format!("`\"{default}\"`");
            assert!(
                default_cell.contains(&quoted) || default_cell.contains(&string),
                "{name}: the page says {default_cell:?}, the declaration {default:?}"
            );
        }
    }
    let declared: Vec<&str> = KEYS.iter().map(|k| k.name).collect();
    for name in &declared {
        assert!(
            documented.iter().any(|d| d == name),
            "{name} is not on the page"
        );
    }

    let env_table = page
        .split("## Environment")
        .nth(1)
        .unwrap()
        .split("\n## ")
        .next()
        .unwrap();
    let mut vars = 0;
    for row in env_table.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = row.split('`').collect();
        let (var, name) = (cells[1], cells[3]);
        let key = KEYS.iter().find(|k| k.name == name).unwrap();
        assert_eq!(key.env, Some(var), "{row}");
        vars += 1;
    }
    assert_eq!(vars, KEYS.iter().filter(|k| k.env.is_some()).count());
    assert_eq!(KEY.hash_seed.env, Some("PYTHONHASHSEED"));
}

#[test]
fn host_liveness_keys_are_checked() {
    use kvpeer::NodeConfig;
    let err = NodeConfig::builder("probe")
        .set("host_probe_timeout_ms", 100)
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("host_probe_timeout_ms") && err.contains("at least 250"),
        "{err}"
    );
    assert!(NodeConfig::builder("probe")
        .set("host_probe_timeout_ms", 0)
        .build()
        .is_ok());
    let err = NodeConfig::builder("group")
        .set("liveness_group", "10.0.0.5:5710")
        .build()
        .unwrap_err()
        .to_string();
    assert!(err.contains("needs liveness_rank"), "{err}");
    let err = NodeConfig::builder("group")
        .set("liveness_group", "10.0.0.5:5710")
        .set("liveness_rank", "8/8")
        .build()
        .unwrap_err()
        .to_string();
    assert!(err.contains("below the group's 8 members"), "{err}");
    let config = NodeConfig::builder("group")
        .set("liveness_group", "10.0.0.5:5710")
        .set("liveness_rank", "3/8")
        .set("heartbeat_interval_ms", 500)
        .set("heartbeat_timeout_ms", 1500)
        .build()
        .unwrap();
    let control = &config.spec.control;
    assert_eq!(
        control.heartbeat_interval,
        std::time::Duration::from_millis(500)
    );
    assert_eq!(
        control.heartbeat_timeout,
        std::time::Duration::from_millis(1500)
    );
    let siblings = control.siblings.as_ref().unwrap();
    assert_eq!(
        (siblings.name.as_str(), siblings.index, siblings.members),
        ("10.0.0.5:5710", 3, 8)
    );
}

/// A secret every user may read is refused, naming the mode and the fix; one only its owner
/// (or its group) may read is taken.
#[test]
fn an_auth_secret_every_user_can_read_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::temp_dir().join(format!("kvpeer-secret-mode-{}", std::process::id()));
    std::fs::write(&path, "a shared secret of 32 bytes, ok.").unwrap();
    let settings = |mode: u32| {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        let file = from_toml(
            &format!("auth_secret_file = {:?}\n", path.display().to_string()),
            "s.toml",
        )
        .unwrap();
        resolve(&file, &env(&[]), &Settings::default(), "t")
    };
    let e = settings(0o644).unwrap_err();
    assert_eq!(e.key, "auth_secret_file");
    assert!(
        e.problem.contains("every user (mode 0644)") && e.problem.contains("chmod 600"),
        "{e}"
    );
    assert!(settings(0o640).unwrap().spec.auth_secret.is_some());
    assert!(settings(0o600).unwrap().spec.auth_secret.is_some());
    std::fs::remove_file(&path).unwrap();
}

/// The data port is never the control port, and a list key's single value must be text.
#[test]
fn a_data_port_on_the_control_port_and_a_numeric_allowlist_are_refused() {
    let file = from_toml("listen_port = 5700\ntcp_port = 5700\n", "p.toml").unwrap();
    let e = resolve(&file, &env(&[]), &Settings::default(), "t").unwrap_err();
    assert_eq!(e.key, "tcp_port");
    assert!(e.problem.contains("is the control port"), "{e}");
    let file = from_toml("listen_port = 5700\ntcp_port = 5800\n", "p.toml").unwrap();
    let c = resolve(&file, &env(&[]), &Settings::default(), "t").unwrap();
    assert!(
        c.spec.tcp_listen.ends_with(":5800"),
        "{}",
        c.spec.tcp_listen
    );

    let e = from_toml("allowlist = 1\n", "a.toml").unwrap_err();
    assert_eq!(e.key, "allowlist");
    assert!(e.problem.contains("a list of strings"), "{e}");
}
