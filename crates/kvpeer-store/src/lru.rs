//! Least-recently-used order over block indexes, every operation O(1).
//!
//! An intrusive doubly-linked list stored in two arrays indexed by block, so it allocates once
//! (at creation) and each block costs 9 bytes (a link and an in-list flag). Written by hand: LRU crates key a hash map by
//! value, which would duplicate the store's own index.

const NONE: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Link {
    prev: u32,
    next: u32,
}

/// The blocks that may be evicted, oldest first.
#[derive(Debug)]
pub(crate) struct Lru {
    links: Vec<Link>,
    in_list: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl Lru {
    /// Memory per block: one link and one flag.
    pub(crate) const BYTES_PER_BLOCK: usize = std::mem::size_of::<Link>() + 1;

    pub(crate) fn new(blocks: usize) -> Self {
        Lru {
            links: vec![
                Link {
                    prev: NONE,
                    next: NONE
                };
                blocks
            ],
            in_list: vec![false; blocks],
            head: NONE,
            tail: NONE,
            len: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn contains(&self, block: u32) -> bool {
        self.in_list.get(block as usize).copied().unwrap_or(false)
    }

    /// Makes `block` the most recently used (inserting it if absent).
    pub(crate) fn touch(&mut self, block: u32) {
        if self.contains(block) {
            self.remove(block);
        }
        let i = block as usize;
        if i >= self.links.len() {
            return;
        }
        self.links[i] = Link {
            prev: self.tail,
            next: NONE,
        };
        match self.tail {
            NONE => self.head = block,
            tail => self.links[tail as usize].next = block,
        }
        self.tail = block;
        self.in_list[i] = true;
        self.len += 1;
    }

    /// Makes `block` the least recently used, the next to go (inserting it if absent): a
    /// block used once, which should not push out the ones used again and again.
    pub(crate) fn push_oldest(&mut self, block: u32) {
        let i = block as usize;
        if i >= self.links.len() {
            return;
        }
        self.remove(block);
        self.links[i] = Link {
            prev: NONE,
            next: self.head,
        };
        match self.head {
            NONE => self.tail = block,
            head => self.links[head as usize].prev = block,
        }
        self.head = block;
        self.in_list[i] = true;
        self.len += 1;
    }

    /// Takes `block` out (no-op if absent).
    pub(crate) fn remove(&mut self, block: u32) {
        if !self.contains(block) {
            return;
        }
        let Link { prev, next } = self.links[block as usize];
        match prev {
            NONE => self.head = next,
            p => self.links[p as usize].next = next,
        }
        match next {
            NONE => self.tail = prev,
            n => self.links[n as usize].prev = prev,
        }
        self.in_list[block as usize] = false;
        self.len -= 1;
    }

    /// Takes the least recently used block out.
    pub(crate) fn pop_oldest(&mut self) -> Option<u32> {
        let head = self.head;
        if head == NONE {
            return None;
        }
        self.remove(head);
        Some(head)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_is_least_recent_first_and_touch_moves_to_the_back() {
        let mut lru = Lru::new(5);
        for b in [3, 1, 4, 0] {
            lru.touch(b);
        }
        lru.touch(1);
        lru.remove(4);
        lru.remove(4);
        assert_eq!(lru.len(), 3);
        let order: Vec<u32> = std::iter::from_fn(|| lru.pop_oldest()).collect();
        assert_eq!(order, vec![3, 0, 1]);
        assert_eq!(lru.len(), 0);
        lru.touch(9);
        assert_eq!(lru.len(), 0, "an index outside the pool is ignored");
        for b in [2, 3] {
            lru.touch(b);
        }
        lru.push_oldest(4);
        lru.push_oldest(3);
        lru.push_oldest(9);
        let order: Vec<u32> = std::iter::from_fn(|| lru.pop_oldest()).collect();
        assert_eq!(
            order,
            vec![3, 4, 2],
            "pushed to the front, newest push first"
        );
    }
}
