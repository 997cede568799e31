//! Kubernetes-safe names derived from a DataPipeline's name. A pipeline name may be a 253-char
//! DNS subdomain with dots; the objects we create need 63-char DNS labels. Whenever a name has
//! to change to fit, a hash of the original keeps different pipelines apart.

use sha2::{Digest, Sha256};

/// Longest DNS-1035 label (Service names) and label value.
pub const MAX_LABEL: usize = 63;

/// `<base><suffix>` as a DNS label of at most 63 characters.
pub fn child(base: &str, suffix: &str) -> String {
    let clean: String =
        base.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).collect();
    let needs_letter_start = !clean.starts_with(|c: char| c.is_ascii_lowercase());
    let fits = clean.len() + suffix.len() <= MAX_LABEL;
    if clean == base && fits && !needs_letter_start {
        return format!("{base}{suffix}");
    }
    let hash = short_hash(base);
    let prefix = if needs_letter_start { "p-" } else { "" };
    // prefix + kept + "-" + hash + suffix <= 63
    let room = MAX_LABEL - prefix.len() - 1 - hash.len() - suffix.len();
    let kept = clean[..clean.len().min(room)].trim_end_matches('-');
    let sep = if kept.is_empty() { "" } else { "-" };
    format!("{prefix}{kept}{sep}{hash}{suffix}")
}

/// A label value (at most 63 characters) that identifies `name`.
pub fn label_value(name: &str) -> String {
    if name.len() <= MAX_LABEL {
        return name.to_string();
    }
    let hash = short_hash(name);
    let kept = name[..MAX_LABEL - 1 - hash.len()].trim_end_matches(['-', '.', '_']);
    format!("{kept}-{hash}")
}

fn short_hash(s: &str) -> String {
    let digest = Sha256::digest(s.as_bytes());
    digest[..4].iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_dns_label(s: &str) -> bool {
        s.len() <= MAX_LABEL
            && s.starts_with(|c: char| c.is_ascii_lowercase())
            && s.ends_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
            && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    }

    #[test]
    fn short_names_are_kept() {
        assert_eq!(child("imagenet-train", "-workers"), "imagenet-train-workers");
        assert_eq!(label_value("imagenet-train"), "imagenet-train");
    }

    #[test]
    fn long_names_are_truncated_with_a_distinguishing_hash() {
        let a = format!("{}-a", "x".repeat(250));
        let b = format!("{}-b", "x".repeat(250));
        let (ca, cb) = (child(&a, "-workers"), child(&b, "-workers"));
        assert!(is_dns_label(&ca) && is_dns_label(&cb), "{ca} {cb}");
        assert!(ca.ends_with("-workers"));
        assert_ne!(ca, cb);
        assert_eq!(ca, child(&a, "-workers"), "stable across calls");
        let (la, lb) = (label_value(&a), label_value(&b));
        assert!(la.len() <= MAX_LABEL && lb.len() <= MAX_LABEL);
        assert_ne!(la, lb);
    }

    #[test]
    fn dotted_and_digit_names_become_dns_labels() {
        for name in ["my.pipeline", "0day", "a.b.c", "9.9"] {
            let c = child(name, "-workers");
            assert!(is_dns_label(&c), "{name} -> {c}");
        }
        assert_ne!(child("a.b", "-workers"), child("a-b", "-workers"));
    }

    #[test]
    fn boundary_length_fits_exactly() {
        let name = "n".repeat(MAX_LABEL - "-workers".len());
        assert_eq!(child(&name, "-workers").len(), MAX_LABEL);
        let longer = "n".repeat(MAX_LABEL - "-workers".len() + 1);
        let c = child(&longer, "-workers");
        assert!(is_dns_label(&c) && c.len() <= MAX_LABEL, "{c}");
    }
}
