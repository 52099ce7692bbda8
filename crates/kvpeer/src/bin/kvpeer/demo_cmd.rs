//! `kvpeer demo`: the README's main job. Two nodes on 127.0.0.1 share KV-cache blocks, with
//! no setup and no engine: a producer holds the blocks of a few prompt prefixes it "computed"
//! earlier, and a consumer runs requests that start with those prefixes. For each request the
//! consumer looks its blocks up at the producer, fetches the ones the producer holds, checks
//! every byte, and would compute only the rest. It prints what happened and exits.
//!
//! Uses only the public API ([`kvpeer::Node`]); blocks follow docs/synthetic-workload.md.

use std::time::{Duration, Instant};

use kvpeer::{synthetic, LookupResult, Node, NodeConfig, NodeError, OffloadKey, PlaneKind};

/// `kvpeer demo` options.
#[derive(Debug, clap::Args)]
pub(crate) struct DemoArgs {
    /// Requests the consumer runs.
    #[arg(long, default_value_t = 24)]
    requests: u64,
    /// Distinct shared prefixes the producer holds.
    #[arg(long, default_value_t = 8)]
    prefixes: u64,
    /// Blocks per prefix.
    #[arg(long, default_value_t = 16)]
    prefix_blocks: u64,
    /// Blocks of each request after its prefix (new to both nodes).
    #[arg(long, default_value_t = 4)]
    suffix_blocks: u64,
    /// Bytes per block.
    #[arg(long, default_value_t = 64 * 1024)]
    block_len: u64,
    /// Data planes of both nodes.
    #[arg(long, value_parser = crate::node_args::plane_parser(), default_value_t = PlaneKind::Both)]
    plane: PlaneKind,
}

/// Tokens a block stands for (vLLM's default block size).
const TOKENS_PER_BLOCK: u64 = 16;
const WAIT: Duration = Duration::from_secs(10);

/// Runs the command; returns the exit status.
pub(crate) fn run(args: DemoArgs) -> u8 {
    if args.requests == 0 || args.prefixes == 0 || args.prefix_blocks == 0 {
        crate::report::fatal!(
            "demo",
            "--requests, --prefixes and --prefix-blocks must be at least 1"
        );
        return 2;
    }
    match demo(&args) {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            crate::report::fatal!("demo", "{e}");
            1
        }
    }
}

fn config(tag: &str, args: &DemoArgs, blocks: u64) -> Result<NodeConfig, NodeError> {
    NodeConfig::builder(tag)
        .num_blocks(blocks)
        .block_len(args.block_len)
        .plane(args.plane)
        .build()
        .map_err(NodeError::from)
}

/// Key `j` of prefix `p`; suffix keys come after every prefix's keys, one range per request.
fn prefix_key(args: &DemoArgs, p: u64, j: u64) -> OffloadKey {
    synthetic::key(p * args.prefix_blocks + j)
}

fn suffix_key(args: &DemoArgs, r: u64, j: u64) -> OffloadKey {
    synthetic::key(args.prefixes * args.prefix_blocks + r * args.suffix_blocks + j)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

fn demo(args: &DemoArgs) -> Result<bool, NodeError> {
    let held = args.prefixes * args.prefix_blocks;
    let len = args.block_len as usize;
    let producer = Node::start(config("demo-producer", args, held)?)?;
    let consumer_blocks = (args.requests * args.prefix_blocks).clamp(held, held * 4);
    let consumer = Node::start(config("demo-consumer", args, consumer_blocks)?)?;
    // The introduction once both nodes run: a node that cannot start is the only thing said.
    println!("kvpeer demo: two nodes on this machine share attention KV-cache blocks.\n");
    println!(
        "An inference engine turns every prompt into a KV cache before it can answer. Prompts often\n\
         start the same way (a system prompt, a shared document), so a node that already computed\n\
         a prefix can hand its blocks to another node instead of that node computing them again.\n"
    );

    let blocks: Vec<(OffloadKey, Vec<u8>)> = (0..args.prefixes)
        .flat_map(|p| (0..args.prefix_blocks).map(move |j| (p, j)))
        .map(|(p, j)| {
            let k = prefix_key(args, p, j);
            let bytes = synthetic::content(&k, len);
            (k, bytes)
        })
        .collect();
    producer.store(blocks)?;
    println!(
        "  producer {}  holds {} prompt prefixes: {held} blocks of {} KiB",
        producer.id(),
        args.prefixes,
        args.block_len / 1024
    );
    println!(
        "  consumer {}  runs {} requests; each starts with one of those prefixes\n",
        consumer.id(),
        args.requests
    );
    println!("  request  prefix  blocks  local  from peer  computed  moved      lookup     fetch");

    let (mut reused, mut total, mut moved, mut corrupt) = (0u64, 0u64, 0u64, 0u64);
    let mut from_local = 0u64;
    let mut fetch_time = Duration::ZERO;
    let started = Instant::now();
    for r in 0..args.requests {
        let p = r % args.prefixes;
        let keys: Vec<OffloadKey> = (0..args.prefix_blocks)
            .map(|j| prefix_key(args, p, j))
            .chain((0..args.suffix_blocks).map(|j| suffix_key(args, r, j)))
            .collect();
        let request = format!("req-{r:02}");
        // Blocks this node already holds (from an earlier request) are reused in place.
        let local = keys
            .iter()
            .take_while(|k| consumer.read(k).is_some())
            .count();
        let rest = &keys[local..];
        let t = Instant::now();
        let req = consumer.request(producer.id(), &request)?;
        let found = req.lookup(rest, WAIT)?;
        let lookup = t.elapsed();
        // A prefix cache reuses the leading run of hits.
        let hits = found
            .iter()
            .take_while(|f| **f == LookupResult::Hit)
            .count();
        let t = Instant::now();
        if hits > 0 {
            req.fetch(&rest[..hits], WAIT)?;
        }
        let fetch = t.elapsed();
        req.finish();
        for k in &rest[..hits] {
            if consumer.read(k) != Some(synthetic::content(k, len)) {
                corrupt += 1;
            }
        }
        let bytes = hits as u64 * args.block_len;
        println!(
            "  {request}   doc-{p}   {:>6}  {local:>5}  {hits:>9}  {:>8}  {:>9}  {:>6.2} ms  {:>5.2} ms",
            keys.len(),
            rest.len() - hits,
            mib(bytes),
            lookup.as_secs_f64() * 1e3,
            fetch.as_secs_f64() * 1e3,
        );
        from_local += local as u64;
        reused += hits as u64;
        total += keys.len() as u64;
        moved += bytes;
        if hits > 0 {
            fetch_time += fetch;
        }
    }
    let elapsed = started.elapsed();
    consumer.shutdown(Duration::from_secs(3));
    producer.shutdown(Duration::from_secs(3));

    println!(
        "\nSummary: {} requests, {total} blocks: {reused} fetched from the peer, {from_local} \
         already local, {} computed ({:.0}% not recomputed); {} moved in {:.0} ms of fetches \
         ({:.2} GB/s), {}.",
        args.requests,
        total - reused - from_local,
        100.0 * (reused + from_local) as f64 / total as f64,
        mib(moved),
        fetch_time.as_secs_f64() * 1e3,
        moved as f64 / fetch_time.as_secs_f64().max(1e-9) / 1e9,
        if corrupt == 0 {
            "every byte verified".to_owned()
        } else {
            format!("{corrupt} blocks CORRUPT")
        }
    );
    println!(
        "Recompute saved by the peer: {reused} blocks × {TOKENS_PER_BLOCK} tokens = {} prompt \
         tokens the consumer did not have to prefill. Whole run: {:.0} ms.",
        reused * TOKENS_PER_BLOCK,
        elapsed.as_secs_f64() * 1e3
    );
    Ok(corrupt == 0)
}
