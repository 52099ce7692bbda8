//! The other ranks of one engine on this host: where a node tells them that it lost a
//! connection to a host (`control/hosts.rs`), and hears the same from them.
//!
//! A vLLM engine with data parallelism runs one process per rank, each with its own node and
//! its own sessions; a host that dies costs each rank its own heartbeat timeout unless the
//! first to notice tells the rest. They share this host (and its network namespace), so they
//! meet in the Linux abstract socket namespace: rank `i` of group `G` binds the datagram
//! socket `@kvpeer-liveness/G/i`, and an announcement is one datagram to every other rank's
//! name. Abstract names need no file and vanish with the process (a restarted rank binds its
//! name again); a rank that is not there (on another host, not started) just misses it.
//!
//! An announcement is one line of text, bounded ([`MAX_DATAGRAM`]):
//! `kvpeer-host v1 unanswered 10.0.0.5` or `kvpeer-host v1 gone 10.0.0.5`. The kernel tells
//! the sender's credentials (`SO_PASSCRED`); anything not from a process of this node's own
//! user, or not of that form, is dropped and counted. An announcement only makes the node
//! probe its own connections to that host (which a live host answers) or, with none, refuse
//! new connections to it for the hold; it is never passed on.
//!
//! Owned by the control channel, on the node's thread; its socket is non-blocking and in the
//! channel's poll set, so hearing costs nothing while nobody speaks.

use std::io::IoSliceMut;
use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

use kvpeer_core::HostSign;
use nix::sys::socket::{
    recvmsg, setsockopt, sockopt, ControlMessageOwned, MsgFlags, UnixAddr, UnixCredentials,
};
use tracing::debug;

/// Largest announcement read (a longer datagram is cut and then refused as malformed).
const MAX_DATAGRAM: usize = 128;

/// Announcements taken per call, so a flood of datagrams cannot hold the node's thread.
pub(crate) const MAX_PER_TAKE: usize = 64;

/// Ranks in one group at most (vLLM's data-parallel sizes are far below).
pub const MAX_MEMBERS: u32 = 1024;

/// One engine's ranks on this host: the group's name (the same in every rank), this rank's
/// index and how many ranks the group has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SiblingGroup {
    /// The group's name (e.g. the engine's control address before its rank's port offset).
    pub name: String,
    /// This rank's index, below `members`.
    pub index: u32,
    /// Ranks in the group.
    pub members: u32,
}

impl SiblingGroup {
    /// The group, checked: a name of 1 to 64 printable characters without `/`, an index below
    /// `members`, at most [`MAX_MEMBERS`] members.
    pub fn new(name: &str, index: u32, members: u32) -> Result<Self, String> {
        if name.is_empty()
            || name.len() > 64
            || !name.chars().all(|c| c.is_ascii_graphic() && c != '/')
        {
            return Err(format!(
                "the liveness group's name must be 1 to 64 printable characters without '/', not {name:?}"
            ));
        }
        if members == 0 || members > MAX_MEMBERS {
            return Err(format!(
                "a liveness group has 1 to {MAX_MEMBERS} members, not {members}"
            ));
        }
        if index >= members {
            return Err(format!(
                "the rank's index {index} must be below the group's {members} members"
            ));
        }
        Ok(SiblingGroup {
            name: name.to_owned(),
            index,
            members,
        })
    }

    /// Rank `index`'s abstract socket name, under this user's id (another user's engine with
    /// the same group name is another group).
    fn address(&self, index: u32) -> String {
        let uid = nix::unistd::getuid().as_raw();
        format!("kvpeer-liveness/{uid}/{}/{index}", self.name)
    }
}

/// The bytes of one announcement.
fn encode(host: IpAddr, sign: HostSign) -> Option<String> {
    let sign = match sign {
        HostSign::Unanswered => "unanswered",
        HostSign::ProcessGone => "gone",
        HostSign::None => return None,
    };
    Some(format!("kvpeer-host v1 {sign} {host}"))
}

/// One announcement read back, or `None` for anything else.
fn decode(bytes: &[u8]) -> Option<(IpAddr, HostSign)> {
    let text = std::str::from_utf8(bytes).ok()?;
    let mut words = text.split(' ');
    if words.next()? != "kvpeer-host" || words.next()? != "v1" {
        return None;
    }
    let sign = match words.next()? {
        "unanswered" => HostSign::Unanswered,
        "gone" => HostSign::ProcessGone,
        _ => return None,
    };
    let host: IpAddr = words.next()?.parse().ok()?;
    if words.next().is_some() {
        return None;
    }
    Some((host.to_canonical(), sign))
}

/// This rank's socket in its group.
#[derive(Debug)]
pub(crate) struct Siblings {
    group: SiblingGroup,
    socket: UnixDatagram,
    /// The other ranks' addresses.
    others: Vec<SocketAddr>,
    uid: u32,
    /// Datagrams dropped: malformed, or from another user.
    refused: u64,
}

impl Siblings {
    /// Binds this rank's name. Fails when another process holds it (another engine with the
    /// same group and index) or the socket cannot be made.
    pub(crate) fn bind(group: SiblingGroup) -> std::io::Result<Self> {
        let socket =
            UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(group.address(group.index))?)?;
        socket.set_nonblocking(true)?;
        setsockopt(&socket, sockopt::PassCred, &true)?;
        let others = (0..group.members)
            .filter(|i| *i != group.index)
            .map(|i| SocketAddr::from_abstract_name(group.address(i)))
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Siblings {
            group,
            socket,
            others,
            uid: nix::unistd::getuid().as_raw(),
            refused: 0,
        })
    }

    /// The socket, for the channel's poll set.
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.socket.as_fd()
    }

    /// Tells every other rank that a connection to `host` was lost with `sign`. Never blocks:
    /// a rank that is not there or whose queue is full misses it.
    pub(crate) fn announce(&self, host: IpAddr, sign: HostSign) {
        let Some(line) = encode(host, sign) else {
            return;
        };
        let mut told = 0;
        for addr in &self.others {
            if self.socket.send_to_addr(line.as_bytes(), addr).is_ok() {
                told += 1;
            }
        }
        debug!(group = %self.group.name, %host, told, "told the engine's other ranks of a lost host connection");
    }

    /// The announcements waiting (at most [`MAX_PER_TAKE`] datagrams read), appended to
    /// `out`; whether more may wait (it stopped before the socket said it was empty).
    pub(crate) fn take(&mut self, out: &mut Vec<(IpAddr, HostSign)>) -> bool {
        for _ in 0..MAX_PER_TAKE {
            let mut buf = [0u8; MAX_DATAGRAM];
            let mut space = nix::cmsg_space!(UnixCredentials);
            let mut iov = [IoSliceMut::new(&mut buf)];
            let (len, uid) = match recvmsg::<UnixAddr>(
                self.socket.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_TRUNC,
            ) {
                Ok(msg) => {
                    let uid = msg.cmsgs().ok().and_then(|mut c| {
                        c.find_map(|m| match m {
                            ControlMessageOwned::ScmCredentials(cred) => Some(cred.uid()),
                            _ => None,
                        })
                    });
                    (msg.bytes, uid)
                }
                Err(nix::errno::Errno::EAGAIN) => return false,
                Err(nix::errno::Errno::EINTR) => continue,
                // Treated as drained (the poll reports the next datagram): a socket that keeps
                // failing must not keep the node's loop awake.
                Err(e) => {
                    if let Some(suppressed) = crate::admit_warning("liveness group read") {
                        tracing::warn!(error = %e, suppressed, "cannot read the liveness group's socket");
                    }
                    return false;
                }
            };
            match (len <= MAX_DATAGRAM, uid == Some(self.uid)) {
                // The sender's real uid (what the kernel attaches) against ours.
                (true, true) => match decode(&buf[..len]) {
                    Some(found) => out.push(found),
                    None => self.refused += 1,
                },
                _ => self.refused += 1,
            }
        }
        true
    }

    /// Datagrams dropped so far.
    pub(crate) fn refused(&self) -> u64 {
        self.refused
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn group(name: &str, index: u32, members: u32) -> SiblingGroup {
        SiblingGroup::new(name, index, members).unwrap()
    }

    #[test]
    fn announcements_read_back_exactly_and_nothing_else_does() {
        let host: IpAddr = "10.0.0.5".parse().unwrap();
        for sign in [HostSign::Unanswered, HostSign::ProcessGone] {
            let line = encode(host, sign).unwrap();
            assert_eq!(decode(line.as_bytes()), Some((host, sign)));
        }
        assert_eq!(encode(host, HostSign::None), None);
        let mapped = "kvpeer-host v1 gone ::ffff:10.0.0.5";
        assert_eq!(
            decode(mapped.as_bytes()),
            Some((host, HostSign::ProcessGone))
        );
        for bad in [
            "",
            "kvpeer-host v2 gone 10.0.0.5",
            "kvpeer-host v1 dead 10.0.0.5",
            "kvpeer-host v1 gone 10.0.0.5 extra",
            "kvpeer-host v1 gone host.example",
            "kvpeer-host v1 gone",
        ] {
            assert_eq!(decode(bad.as_bytes()), None, "{bad:?}");
        }
        assert_eq!(decode(&[0xff, 0xfe]), None);
    }

    #[test]
    fn a_group_is_checked() {
        assert!(SiblingGroup::new("10.0.0.5:5710", 0, 8).is_ok());
        for (name, index, members) in [
            ("", 0, 1),
            ("a/b", 0, 1),
            ("a b", 0, 1),
            ("g", 2, 2),
            ("g", 0, 0),
            ("g", 0, MAX_MEMBERS + 1),
        ] {
            assert!(
                SiblingGroup::new(name, index, members).is_err(),
                "{name} {index} {members}"
            );
        }
        assert!(SiblingGroup::new(&"x".repeat(65), 0, 1).is_err());
    }

    #[test]
    fn ranks_hear_each_other_and_junk_is_dropped_and_counted() {
        let name = format!("unit-{}", std::process::id());
        let mut a = Siblings::bind(group(&name, 0, 3)).unwrap();
        let mut b = Siblings::bind(group(&name, 1, 3)).unwrap();
        // Rank 2 never started: telling it costs nothing.
        let host: IpAddr = "10.1.2.3".parse().unwrap();
        a.announce(host, HostSign::Unanswered);
        let mut heard = Vec::new();
        b.take(&mut heard);
        assert_eq!(heard, vec![(host, HostSign::Unanswered)]);
        let mut own = Vec::new();
        a.take(&mut own);
        assert!(own.is_empty(), "a rank does not hear itself");
        // The same index twice: refused at bind.
        assert!(Siblings::bind(group(&name, 1, 3)).is_err());
        // Junk sent to b's name: dropped and counted.
        let stranger = UnixDatagram::unbound().unwrap();
        let b_addr = SocketAddr::from_abstract_name(group(&name, 1, 3).address(1)).unwrap();
        stranger
            .send_to_addr(b"kvpeer-host v1 gone nowhere", &b_addr)
            .unwrap();
        stranger.send_to_addr(&[b'x'; 4096], &b_addr).unwrap();
        let mut heard = Vec::new();
        b.take(&mut heard);
        assert!(heard.is_empty());
        assert_eq!(b.refused(), 2);
    }
}
