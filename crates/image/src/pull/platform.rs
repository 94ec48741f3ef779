//! Platforms: the host's, in OCI's names, and how an index entry matches one.
//!
//! OCI names architectures after Go (`amd64`, `arm64`), not after Rust or
//! the kernel (`x86_64`, `aarch64`); everything in this module speaks OCI's
//! names and maps the others onto them. It does no I/O.

use std::fmt;

/// An OCI platform: what an image index entry is built for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Platform {
    /// Operating system, e.g. `linux`.
    pub os: String,
    /// Architecture in OCI's names, e.g. `amd64`, `arm64`.
    pub architecture: String,
    /// Architecture variant, e.g. `v7` for 32-bit ARM; `None` matches the
    /// architecture's default (see [`Platform::rank_match`]).
    pub variant: Option<String>,
}

impl Platform {
    /// A platform from its parts.
    pub fn new(os: &str, architecture: &str, variant: Option<&str>) -> Self {
        Self {
            os: os.to_string(),
            architecture: architecture.to_string(),
            variant: variant.map(str::to_string),
        }
    }

    /// The platform this binary runs on: `linux` and the host architecture.
    pub fn host() -> Self {
        Self::new("linux", oci_architecture(std::env::consts::ARCH), None)
    }

    /// How well an index entry for `entry` serves a pull for `self`:
    /// `Some(0)` for an exact match, `Some(1)` for the same OS and
    /// architecture with some other variant when `self` names none, `None`
    /// when it cannot serve.
    ///
    /// Variants are compared after filling in the architecture's default
    /// (`arm64` means `arm64/v8`, `amd64` means `amd64/v1`), since indexes
    /// write either form.
    pub fn rank_match(&self, entry: &Platform) -> Option<u8> {
        if !self.os.eq_ignore_ascii_case(&entry.os) {
            return None;
        }
        let arch = oci_architecture(&self.architecture);
        if arch != oci_architecture(&entry.architecture) {
            return None;
        }
        let want = normal_variant(arch, self.variant.as_deref());
        let have = normal_variant(arch, entry.variant.as_deref());
        if want == have {
            Some(0)
        } else if self.variant.is_none() {
            // Nothing was asked for beyond the architecture: any variant of
            // it is better than failing, but an exact default wins.
            Some(1)
        } else {
            None
        }
    }
}

impl Default for Platform {
    /// The host platform.
    fn default() -> Self {
        Self::host()
    }
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}

/// Maps an architecture name (Rust's `std::env::consts::ARCH`, the
/// kernel's `uname -m`, or already OCI's) to OCI's name. Unknown names pass
/// through unchanged, so they can still match an index that uses them.
pub fn oci_architecture(arch: &str) -> &str {
    match arch {
        "x86_64" | "x86-64" | "amd64" => "amd64",
        "aarch64" | "arm64" => "arm64",
        "x86" | "i386" | "i686" | "386" => "386",
        "arm" | "armv7l" | "armv6l" => "arm",
        "powerpc64le" | "ppc64le" => "ppc64le",
        "powerpc64" | "ppc64" => "ppc64",
        "loongarch64" | "loong64" => "loong64",
        "mips64" => "mips64",
        other => other,
    }
}

/// The variant with the architecture's default filled in.
fn normal_variant<'a>(arch: &str, variant: Option<&'a str>) -> Option<&'a str> {
    match (arch, variant) {
        ("arm64", None) => Some("v8"),
        ("amd64", None) => Some("v1"),
        (_, v) => v,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architecture_names() {
        assert_eq!(oci_architecture("x86_64"), "amd64");
        assert_eq!(oci_architecture("aarch64"), "arm64");
        assert_eq!(oci_architecture("amd64"), "amd64");
        assert_eq!(oci_architecture("arm64"), "arm64");
        assert_eq!(oci_architecture("x86"), "386");
        assert_eq!(oci_architecture("powerpc64le"), "ppc64le");
        assert_eq!(oci_architecture("s390x"), "s390x");
        assert_eq!(oci_architecture("riscv64"), "riscv64");
    }

    #[test]
    fn host_is_linux_in_oci_names() {
        let host = Platform::host();
        assert_eq!(host.os, "linux");
        assert_eq!(host.variant, None);
        #[cfg(target_arch = "x86_64")]
        assert_eq!(host.architecture, "amd64");
        #[cfg(target_arch = "aarch64")]
        assert_eq!(host.architecture, "arm64");
        assert_eq!(Platform::default(), host);
    }

    #[test]
    fn matching() {
        let p = |os: &str, arch: &str, v: Option<&str>| Platform::new(os, arch, v);
        let arm64 = p("linux", "arm64", None);
        assert_eq!(arm64.rank_match(&p("linux", "arm64", None)), Some(0));
        assert_eq!(arm64.rank_match(&p("linux", "arm64", Some("v8"))), Some(0));
        assert_eq!(arm64.rank_match(&p("linux", "aarch64", None)), Some(0));
        assert_eq!(arm64.rank_match(&p("linux", "arm64", Some("v9"))), Some(1));
        assert_eq!(arm64.rank_match(&p("linux", "amd64", None)), None);
        assert_eq!(arm64.rank_match(&p("windows", "arm64", None)), None);

        let armv7 = p("linux", "arm", Some("v7"));
        assert_eq!(armv7.rank_match(&p("linux", "arm", Some("v7"))), Some(0));
        assert_eq!(armv7.rank_match(&p("linux", "arm", Some("v6"))), None);
        assert_eq!(
            p("linux", "arm", None).rank_match(&p("linux", "arm", Some("v6"))),
            Some(1)
        );

        let amd64 = p("linux", "amd64", None);
        assert_eq!(amd64.rank_match(&p("Linux", "x86_64", None)), Some(0));
        assert_eq!(amd64.rank_match(&p("linux", "amd64", Some("v3"))), Some(1));
        assert_eq!(p("linux", "amd64", Some("v3")).rank_match(&amd64), None);
    }

    #[test]
    fn display() {
        assert_eq!(
            Platform::new("linux", "arm", Some("v7")).to_string(),
            "linux/arm/v7"
        );
        assert_eq!(
            Platform::new("linux", "amd64", None).to_string(),
            "linux/amd64"
        );
    }
}
