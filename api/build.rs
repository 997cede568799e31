//! Generates the gRPC code from api/proto with a vendored `protoc`, so building Stoker needs no
//! protobuf compiler on the machine.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let mut config = prost_build::Config::new();
    // Given to prost directly rather than through PROTOC, so nothing mutates the environment.
    config.protoc_executable(protoc);
    // `bytes` fields become bytes::Bytes: tensor payloads are sliced, never copied.
    config.bytes(["."]);
    tonic_prost_build::configure()
        // Callers choose their transport (the worker serves with tonic's, tests may not).
        .build_transport(false)
        .compile_with_config(
            config,
            &["proto/stoker/v1alpha1/data.proto", "proto/stoker/v1alpha1/dispatcher.proto"],
            &["proto"],
        )?;
    Ok(())
}
