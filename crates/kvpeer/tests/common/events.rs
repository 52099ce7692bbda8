//! A late subscriber of a KV event stream (kvpeer's own subscriber): what the stream's replay
//! socket gives back from the start.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvpeer_net::events::{EventSubscriber, SubEndpoint, SubEvent, SubscriberConfig};
use kvpeer_proto::events::{decode_batch, EventLimits, KvEvent};

/// Every event a replay of `publish` (through `replay`) from sequence 0 brings, asked again
/// (bounded: 20 s) until `done` says the replay holds what the caller waits for (a publisher
/// that has not published its first batch yet replays nothing).
pub(crate) fn replayed_until(
    publish: SocketAddr,
    replay: SocketAddr,
    done: impl Fn(&[KvEvent]) -> bool,
) -> Vec<KvEvent> {
    let mut config = SubscriberConfig::new(SubEndpoint::Connect(publish));
    config.replay = Some(replay);
    let mut sub = EventSubscriber::new(config).unwrap();
    let mut events = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(Instant::now() < deadline, "no replay end; got {events:?}");
        sub.wait(Duration::from_millis(50)).unwrap();
        while let Some(e) = sub.poll_event() {
            match e {
                SubEvent::Connected => sub.request_replay(0),
                SubEvent::Replayed { payload, .. } => {
                    let batch = decode_batch(&payload, &EventLimits::default()).unwrap();
                    events.extend(batch.events.into_iter().map(Result::unwrap));
                }
                SubEvent::ReplayEnd if done(&events) => return events,
                SubEvent::ReplayEnd => {
                    std::thread::sleep(Duration::from_millis(100));
                    events.clear();
                    sub.request_replay(0);
                }
                SubEvent::Live { .. } | SubEvent::Lost { .. } => {}
            }
        }
    }
}
