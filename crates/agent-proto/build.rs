//! Compiles `proto/agent.proto` with a vendored `protoc`, so a fresh machine
//! needs no protobuf compiler installed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // Build scripts are single-threaded, so setting the variable that
    // prost-build reads cannot race with another thread.
    std::env::set_var("PROTOC", protoc);
    println!("cargo:rerun-if-changed=proto/agent.proto");
    tonic_prost_build::configure().compile_protos(&["proto/agent.proto"], &["proto"])?;
    Ok(())
}
