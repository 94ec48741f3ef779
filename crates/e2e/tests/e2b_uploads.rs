//! An E2B upload the daemon refuses part-way (its path escapes the sandbox)
//! is answered with the refusal even while the client is still sending its
//! body: the daemon reads the rest first, so the client sees `400`, not a
//! connection reset under its write.

use std::time::Duration;

use runbox_e2e::TestDaemon;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_upload_is_answered_after_the_body_the_client_was_still_sending() {
    let daemon = TestDaemon::start(None).await;
    let id = daemon.create().await.id.to_string();
    let connected: serde_json::Value = reqwest::Client::new()
        .post(format!("{}/sandboxes/{id}/connect", daemon.url))
        .header("X-API-Key", &daemon.token)
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let access = connected["envdAccessToken"]
        .as_str()
        .expect("an access token");
    let addr = daemon.url.trim_start_matches("http://").to_owned();

    let part_head =
        "--XYZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"escape\"\r\n\
                     Content-Type: application/octet-stream\r\n\r\n";
    let content = vec![b'n'; 256 << 10];
    let tail = "\r\n--XYZ--\r\n";
    let length = part_head.len() + content.len() + tail.len();
    let head = format!(
        "POST /files?path=%2Ftmp%2F..%2F..%2Fetc%2Fescape HTTP/1.1\r\nHost: {addr}\r\n\
         E2b-Sandbox-Id: {id}\r\nX-Access-Token: {access}\r\n\
         Content-Type: multipart/form-data; boundary=XYZ\r\nContent-Length: {length}\r\n\r\n"
    );
    let mut socket = tokio::net::TcpStream::connect(&addr).await.unwrap();
    socket.write_all(head.as_bytes()).await.unwrap();
    socket.write_all(part_head.as_bytes()).await.unwrap();
    // The refusal is decided now; the body is still on its way.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for chunk in content.chunks(16 << 10) {
        if let Err(e) = socket.write_all(chunk).await {
            let mut early = vec![0u8; 4096];
            let n = socket.read(&mut early).await.unwrap_or(0);
            panic!(
                "the daemon stopped reading a body it refused ({e}); it said: {}",
                String::from_utf8_lossy(&early[..n])
            );
        }
    }
    socket.write_all(tail.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = [0u8; 4096];
        loop {
            match socket.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => {
                    answer.extend_from_slice(&buf[..n]);
                    if answer.windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                Err(e) => panic!("reading the answer: {e}"),
            }
        }
    })
    .await;
    assert!(read.is_ok(), "no answer");
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 400"), "{text}");
    // Nothing was written outside the sandbox, or inside it.
    assert!(!std::path::Path::new("/etc/escape").exists());
}
