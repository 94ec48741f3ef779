//! A read budget around the raw tar stream.
//!
//! The `tar` crate reads a PAX extension header or a GNU long name/long link
//! entry into memory whole, however large its header says it is, before it
//! hands us the entry it describes. Left alone, one hostile header could make
//! the daemon allocate gigabytes. This module owns the cap: the unpack loop
//! grants a small allowance before asking for each entry (enough for headers,
//! long names and padding) and exactly the entry's size before reading its
//! data, and the wrapped reader fails any read past the allowance.
//!
//! It knows nothing about tar; it only counts bytes.

use std::cell::Cell;
use std::io::{self, Read};
use std::rc::Rc;

/// The allowance shared between the unpack loop and [`Budgeted`].
#[derive(Debug, Default)]
pub(crate) struct Budget {
    left: Cell<u64>,
    exceeded: Cell<bool>,
}

impl Budget {
    /// Replaces the allowance with `bytes`. Unused allowance is dropped so
    /// that a long run of small entries cannot save up for one huge header.
    pub(crate) fn allow(&self, bytes: u64) {
        self.left.set(bytes);
    }

    /// Whether a read has been refused for lack of allowance.
    pub(crate) fn exceeded(&self) -> bool {
        self.exceeded.get()
    }
}

/// A reader that fails once it has returned its [`Budget`]'s allowance.
pub(crate) struct Budgeted<R> {
    inner: R,
    budget: Rc<Budget>,
}

impl<R> Budgeted<R> {
    /// Wraps `inner`; reads draw on `budget`.
    pub(crate) fn new(inner: R, budget: Rc<Budget>) -> Self {
        Self { inner, budget }
    }
}

impl<R: Read> Read for Budgeted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let left = self.budget.left.get();
        if left == 0 {
            self.budget.exceeded.set(true);
            return Err(io::Error::other("layer archive read over its budget"));
        }
        let want = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
        let got = self.inner.read(&mut buf[..want])?;
        // `got <= want <= left`, so this cannot underflow.
        self.budget.left.set(left - got as u64);
        Ok(got)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stops_at_the_allowance() {
        let budget = Rc::new(Budget::default());
        let mut reader = Budgeted::new(&[7u8; 100][..], Rc::clone(&budget));
        budget.allow(10);
        let mut buf = [0u8; 64];
        assert_eq!(reader.read(&mut buf).unwrap(), 10);
        assert!(reader.read(&mut buf).is_err());
        assert!(budget.exceeded());
    }

    #[test]
    fn allowance_is_replaced_not_added() {
        let budget = Rc::new(Budget::default());
        let mut reader = Budgeted::new(&[7u8; 100][..], Rc::clone(&budget));
        budget.allow(50);
        budget.allow(5);
        let mut buf = [0u8; 64];
        assert_eq!(reader.read(&mut buf).unwrap(), 5);
        assert!(!budget.exceeded());
    }
}
