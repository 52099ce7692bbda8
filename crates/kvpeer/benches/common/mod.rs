//! What the pool benchmarks share (`pool.rs`, issue 15; `pool_shards.rs`, issue 21): the
//! seeded random numbers and Zipf draws of their workloads, one engine's handling of a
//! request, and the frame of their SVG plots.

#![allow(dead_code)]

use std::fmt::Write as _;
use std::time::Duration;

use kvpeer::{synthetic, Node, OffloadKey, Pull, Sources};

/// What an engine did for one request.
pub(crate) struct Served {
    /// Leading chunks it held itself.
    pub(crate) local: usize,
    /// Chunks after those it fetched from the pool.
    pub(crate) pool: usize,
    /// Chunks it recomputed.
    pub(crate) miss: usize,
    /// The pool lookup's round trip, if it asked one.
    pub(crate) lookup: Option<Duration>,
    /// Whether a fetched chunk's bytes were checked.
    pub(crate) checked: bool,
}

fn leading(flags: impl IntoIterator<Item = bool>) -> usize {
    flags.into_iter().take_while(|h| *h).count()
}

/// `engine` serves a request for `keys` (one prefix's chunks of `len` bytes, the first its
/// root): the leading chunks it holds (they become its most recently used), then what a tier's
/// `sources` find of the rest ([`Node::pull`]: the pool that owns the prefix's root, one
/// lookup, the leading hits fetched, the last one byte-checked if `check`), then the rest
/// recomputed into its tier, which announces them. No sources: no pool.
pub(crate) fn serve(
    engine: &Node,
    sources: &Sources,
    keys: &[OffloadKey],
    id: &str,
    len: usize,
    check: bool,
) -> Served {
    let local = leading(engine.touch(keys).unwrap());
    let mut rest = &keys[local..];
    let mut served = Served {
        local,
        pool: 0,
        miss: 0,
        lookup: None,
        checked: false,
    };
    if !sources.pools().is_empty() && !rest.is_empty() {
        let pull = Pull {
            id: id.to_owned(),
            hint: None,
            root: Some(keys[0].clone()),
        };
        let pulled = engine.pull(sources, &pull, rest).unwrap();
        served.lookup = Some(pulled.lookup);
        served.pool = pulled.fetched;
        if check && pulled.fetched > 0 {
            let k = &rest[pulled.fetched - 1];
            assert_eq!(
                engine.read(k),
                Some(synthetic::content(k, len)),
                "a pool hit's bytes"
            );
            served.checked = true;
        }
        rest = &rest[served.pool..];
    }
    if !rest.is_empty() {
        let missing = rest.to_vec();
        engine
            .store_with(rest, move |j, block| {
                block.copy_from_slice(&synthetic::content(&missing[j], len));
            })
            .unwrap();
    }
    served.miss = rest.len();
    served
}

/// splitmix64: small, seeded, good enough for a workload.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Zipf over ranks `0..n` (rank r with weight 1/(r+1)^s), by inverse CDF.
pub(crate) struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    pub(crate) fn new(n: u64, s: f64) -> Self {
        let mut cdf = Vec::with_capacity(n as usize);
        let mut acc = 0.0;
        for r in 0..n {
            acc += 1.0 / ((r + 1) as f64).powf(s);
            cdf.push(acc);
        }
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf }
    }

    pub(crate) fn sample(&self, rng: &mut Rng) -> u64 {
        let u = rng.unit();
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1) as u64
    }
}

/// A hit-rate plot: `points` values in [0, 1] per series, one per window of `window` requests.
pub(crate) struct Plot {
    pub(crate) w: f64,
    pub(crate) h: f64,
    pub(crate) left: f64,
    pub(crate) right: f64,
    pub(crate) top: f64,
    pub(crate) bottom: f64,
    pub(crate) points: usize,
}

impl Plot {
    pub(crate) fn new(points: usize) -> Self {
        Plot {
            w: 720.0,
            h: 400.0,
            left: 60.0,
            right: 20.0,
            top: 40.0,
            bottom: 50.0,
            points: points.max(1),
        }
    }

    pub(crate) fn x(&self, i: usize) -> f64 {
        self.left + (i as f64 + 1.0) / self.points as f64 * (self.w - self.left - self.right)
    }

    pub(crate) fn y(&self, v: f64) -> f64 {
        self.top + (1.0 - v) * (self.h - self.top - self.bottom)
    }

    /// The SVG's head: background, title, the percentage grid, the axes and the request
    /// ticks (`window` requests per point).
    pub(crate) fn frame(&self, title: &str, window: usize) -> String {
        let (w, h, left, right, top, bottom) =
            (self.w, self.h, self.left, self.right, self.top, self.bottom);
        let mut s = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" \
             font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
        );
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">{title}</text>",
            w / 2.0
        );
        for t in 0..=5 {
            let v = t as f64 / 5.0;
            let _ = writeln!(
                s,
                "<line x1=\"{left}\" x2=\"{}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{:.0}%</text>",
                w - right,
                self.y(v),
                self.y(v),
                left - 6.0,
                self.y(v) + 4.0,
                v * 100.0
            );
        }
        let _ = writeln!(
            s,
            "<line x1=\"{left}\" x2=\"{left}\" y1=\"{top}\" y2=\"{}\" stroke=\"black\"/><line x1=\"{left}\" x2=\"{}\" y1=\"{}\" y2=\"{}\" stroke=\"black\"/>",
            h - bottom,
            w - right,
            h - bottom,
            h - bottom
        );
        let reqs = self.points * window;
        for t in 0..=4 {
            let i = reqs * t / 4;
            let px = left + i as f64 / reqs.max(1) as f64 * (w - left - right);
            let _ = writeln!(
                s,
                "<text x=\"{px:.1}\" y=\"{}\" text-anchor=\"middle\">{i}</text>",
                h - bottom + 16.0
            );
        }
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">requests</text>",
            (left + w - right) / 2.0,
            h - 8.0
        );
        s
    }

    /// One series' line.
    pub(crate) fn line(&self, values: &[f64], colour: &str, dash: &str) -> String {
        let mut pts = String::new();
        for (i, v) in values.iter().enumerate() {
            let _ = write!(pts, "{:.1},{:.1} ", self.x(i), self.y(*v));
        }
        format!(
            "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"2\" {dash} points=\"{}\"/>\n",
            pts.trim_end()
        )
    }

    /// Legend entry `k` (of `of`), bottom right.
    pub(crate) fn legend(
        &self,
        k: usize,
        of: usize,
        colour: &str,
        dash: &str,
        label: &str,
    ) -> String {
        let ly = self.h - self.bottom - 16.0 - 18.0 * (of - k) as f64;
        format!(
            "<line x1=\"{}\" x2=\"{}\" y1=\"{ly}\" y2=\"{ly}\" stroke=\"{colour}\" stroke-width=\"2\" {dash}/><text x=\"{}\" y=\"{}\">{label}</text>\n",
            self.w - self.right - 290.0,
            self.w - self.right - 260.0,
            self.w - self.right - 252.0,
            ly + 4.0
        )
    }
}
