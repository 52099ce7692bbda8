//! The metrics endpoint's probes for an operator: `/healthz` (the node answers), `/readyz`
//! (it answers and every followed engine's event stream is connected), `/metrics` with the
//! build and the process, a query string ignored, an unknown path told where to go.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpeer::{Node, NodeConfig};
use kvpeer_net::events::{EventPublisher, PublisherConfig};

mod common;
use common::{free_port, http_get, metrics_addr, samples, Proc};

#[test]
fn a_node_is_healthy_and_ready_and_its_metrics_carry_the_build_and_the_process() {
    let node = Arc::new(Node::start(NodeConfig::local("health")).unwrap());
    let addr = kvpeer::metrics::serve("127.0.0.1:0", node.clone())
        .unwrap()
        .to_string();
    let (head, body) = http_get(&addr, "/healthz");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(body, "ok\n");
    let (head, body) = http_get(&addr, "/readyz");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(body, "ready\n");

    let (head, body) = http_get(&addr, "/metrics?format=text");
    assert!(
        head.starts_with("HTTP/1.1 200"),
        "a query string is ignored: {head}"
    );
    let m = samples(&body);
    let build = format!(
        "kvpeer_build_info{{version=\"{}\",vllm=\"{}\"}}",
        env!("CARGO_PKG_VERSION"),
        kvpeer::SUPPORTED_VLLM
    );
    assert_eq!(m.get(&build), Some(&1.0), "{body}");
    assert!(m["process_resident_memory_bytes"] > 1e6, "{body}");
    assert!(m["process_open_fds"] >= 3.0, "{body}");
    assert!(m["process_cpu_seconds_total"] >= 0.0, "{body}");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let started = m["process_start_time_seconds"];
    assert!(
        started <= now + 1.0 && started > now - 3600.0,
        "{started} {now}"
    );

    let (head, body) = http_get(&addr, "/health");
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
    assert!(
        body.contains("/healthz") && body.contains("/readyz"),
        "{body}"
    );

    // A node that stopped is neither healthy nor ready (its endpoint outlives it here).
    node.shutdown(Duration::from_secs(1));
    let (head, _) = http_get(&addr, "/healthz");
    assert!(head.starts_with("HTTP/1.1 503"), "{head}");
    let (head, _) = http_get(&addr, "/readyz");
    assert!(head.starts_with("HTTP/1.1 503"), "{head}");
}

#[test]
fn a_pool_node_is_ready_only_once_its_engines_event_streams_are_connected() {
    // The followed engine's PUB is not there yet.
    let events = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let follow = format!("tcp://{events}=127.0.0.1:{}", free_port());
    let (mut node, _) = Proc::serve(&["--follow", &follow, "--metrics", "127.0.0.1:0"]);
    let addr = metrics_addr(&node);
    let (head, _) = http_get(&addr, "/healthz");
    assert!(head.starts_with("HTTP/1.1 200"), "healthy: {head}");
    let (head, body) = http_get(&addr, "/readyz");
    assert!(head.starts_with("HTTP/1.1 503"), "{head}");
    assert_eq!(
        body,
        "not ready: 0 of 1 followed engines' event streams connected\n"
    );

    // The engine's PUB comes up: the pool's SUB connects, and the node is ready.
    let stop = Arc::new(AtomicBool::new(false));
    let serving = {
        let stop = stop.clone();
        let mut publisher = EventPublisher::bind(PublisherConfig::new(events)).unwrap();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let _ = publisher.serve(Duration::from_millis(20), |_| Vec::<Vec<Vec<u8>>>::new());
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (head, body) = http_get(&addr, "/readyz");
        if head.starts_with("HTTP/1.1 200") {
            assert_eq!(body, "ready\n");
            break;
        }
        assert!(Instant::now() < deadline, "never ready: {body}");
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::Relaxed);
    serving.join().unwrap();
    assert_eq!(node.terminate(Duration::from_secs(20)), 0);
}

/// Every series `/metrics` exports is named in docs/configuration.md, or for a pool node's
/// own in docs/pool.md (written out, or in a brace list such as
/// `kvpeer_pool_{blocks,free_blocks}`), for a node and a pool node.
#[test]
fn every_exported_series_is_documented() {
    let docs = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/");
    let page = ["configuration.md", "pool.md"]
        .map(|p| std::fs::read_to_string(format!("{docs}{p}")).unwrap())
        .join("\n");
    // The page's names, braces expanded: `a_{b,c}_d` is `a_b_d` and `a_c_d`.
    let mut names: Vec<String> = Vec::new();
    for word in page.split('`') {
        // A brace list holds a comma; `name{label}` is a series with its label.
        let Some(open) = word.find('{').filter(|_| word.contains(',')) else {
            names.push(word.split('{').next().unwrap_or(word).to_owned());
            continue;
        };
        let Some(close) = word[open..].find('}').map(|c| open + c) else {
            continue;
        };
        for part in word[open + 1..close].split(',') {
            names.push(format!("{}{}{}", &word[..open], part, &word[close + 1..]));
        }
    }
    let documented = |series: &str| {
        let base = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|s| series.strip_suffix(s))
            .unwrap_or(series);
        names.iter().any(|n| n == series || n == base)
    };
    let events = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let follow = format!("tcp://{events}=127.0.0.1:{}", free_port());
    for extra in [&[][..], &["--follow", follow.as_str()][..]] {
        let mut args = vec!["--metrics", "127.0.0.1:0", "--fill", "2"];
        args.extend_from_slice(extra);
        let (mut node, _) = Proc::serve(&args);
        let (_, body) = http_get(&metrics_addr(&node), "/metrics");
        let undocumented: Vec<String> = samples(&body)
            .keys()
            .map(|k| k.split('{').next().unwrap_or(k).to_owned())
            .filter(|s| !s.starts_with("process_") && s != "kvpeer_build_info")
            .filter(|s| !documented(s))
            .collect();
        assert!(undocumented.is_empty(), "{extra:?}: {undocumented:?}");
        assert_eq!(node.terminate(Duration::from_secs(20)), 0);
    }
}
