//! Unpack against a real agent: an archive streamed in chunks that do not
//! line up with its entries, a refusal that answers while the archive is
//! still arriving, and a stream that breaks off before commit.
//!
//! The agent under test runs on the host, so its root filesystem is the
//! host's: destinations are in each test's temporary directory.

mod common;

use common::*;
use runbox_agent_proto::pb::{
    unpack_chunk, UnpackChunk, UnpackHeader, UnpackReply, WriteFileCommit,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status};

fn header(dest: &str) -> UnpackChunk {
    UnpackChunk {
        kind: Some(unpack_chunk::Kind::Header(UnpackHeader {
            dest: dest.to_owned(),
            user: String::new(),
            mode: 0,
        })),
    }
}

fn data(bytes: &[u8]) -> UnpackChunk {
    UnpackChunk {
        kind: Some(unpack_chunk::Kind::Data(bytes.to_vec())),
    }
}

fn commit() -> UnpackChunk {
    UnpackChunk {
        kind: Some(unpack_chunk::Kind::Commit(WriteFileCommit {})),
    }
}

/// An archive of `files` (name, contents).
fn archive(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (name, contents) in files {
        let mut header = tar::Header::new_gnu();
        header.set_mode(0o644);
        header.set_size(contents.len() as u64);
        builder.append_data(&mut header, name, *contents).unwrap();
    }
    builder.into_inner().unwrap()
}

/// Sends `messages` as one Unpack call and answers its reply.
async fn unpack(agent: &mut TestAgent, messages: Vec<UnpackChunk>) -> Result<UnpackReply, Status> {
    let call = agent.client.unpack(tokio_stream::iter(messages));
    tokio::time::timeout(PATIENCE, call)
        .await
        .expect("unpack stalled")
        .map(tonic::Response::into_inner)
}

#[tokio::test]
async fn an_archive_in_odd_chunks_is_unpacked() {
    let mut agent = TestAgent::start().await;
    let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let bytes = archive(&[("a/small.txt", b"small"), ("a/big.bin", &big)]);
    let dest = agent.dir.path().join("out");
    let mut messages = vec![header(dest.to_str().unwrap())];
    messages.extend(bytes.chunks(7_001).map(data));
    messages.push(commit());
    let reply = unpack(&mut agent, messages).await.unwrap();
    assert_eq!((reply.entries, reply.bytes), (2, 5 + big.len() as u64));
    assert_eq!(std::fs::read(dest.join("a/small.txt")).unwrap(), b"small");
    assert!(std::fs::read(dest.join("a/big.bin")).unwrap() == big);
}

#[tokio::test]
async fn a_refused_entry_answers_before_the_archive_ends() {
    let mut agent = TestAgent::start().await;
    let dest = agent.dir.path().join("out");
    let mut bytes = archive(&[("ok", b"ok")]);
    // A fifo entry, then the archive never ends: the call is kept open.
    let mut fifo = tar::Header::new_gnu();
    fifo.set_entry_type(tar::EntryType::Fifo);
    fifo.set_path("fifo").unwrap();
    fifo.set_size(0);
    fifo.set_cksum();
    bytes.truncate(bytes.len() - 1024);
    bytes.extend_from_slice(fifo.as_bytes());
    let (tx, rx) = mpsc::channel(8);
    tx.send(header(dest.to_str().unwrap())).await.unwrap();
    tx.send(data(&bytes)).await.unwrap();
    let call = agent.client.unpack(ReceiverStream::new(rx));
    let status = tokio::time::timeout(PATIENCE, call)
        .await
        .expect("the refusal should not wait for more of the archive")
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("fifo"), "{status:?}");
    assert_eq!(std::fs::read(dest.join("ok")).unwrap(), b"ok");
    drop(tx);
}

#[tokio::test]
async fn a_stream_without_commit_fails_and_keeps_what_arrived() {
    let mut agent = TestAgent::start().await;
    let dest = agent.dir.path().join("out");
    let bytes = archive(&[("first", b"first"), ("second", b"second")]);
    // Everything but commit.
    let messages = vec![header(dest.to_str().unwrap()), data(&bytes)];
    let status = unpack(&mut agent, messages).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("commit"), "{status:?}");
    // Entries are written as they arrive; the caller throws the run away.
    assert_eq!(std::fs::read(dest.join("first")).unwrap(), b"first");
}

#[tokio::test]
async fn the_header_comes_first_and_the_destination_is_absolute() {
    let mut agent = TestAgent::start().await;
    let status = unpack(&mut agent, vec![data(b"x"), commit()])
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    let status = unpack(&mut agent, vec![header("relative/dir"), commit()])
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    // An empty archive is fine, and makes the destination.
    let dest = agent.dir.path().join("empty/dest");
    let reply = unpack(&mut agent, vec![header(dest.to_str().unwrap()), commit()])
        .await
        .unwrap();
    assert_eq!((reply.entries, reply.bytes), (0, 0));
    assert!(dest.is_dir());
}
