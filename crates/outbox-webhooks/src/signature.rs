//! The Standard Webhooks signature scheme (spec/standard-webhooks.md in the standard-webhooks
//! repository): `webhook-signature` is `v1,` and the base64 of HMAC-SHA256, keyed by the
//! secret's bytes, over `{webhook-id}.{webhook-timestamp}.{body}`; several signatures are
//! space-separated (a rotation's overlap). Secrets are `whsec_` and the base64 of their bytes.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::Error;

/// What every secret starts with.
pub const SECRET_PREFIX: &str = "whsec_";

/// Random bytes in a generated secret (the spec asks for at least 24).
pub const SECRET_BYTES: usize = 32;

/// The fewest bytes a secret given by an operator may carry.
pub const MIN_SECRET_BYTES: usize = 24;

/// The most bytes a secret may carry (the spec's upper bound is 64).
pub const MAX_SECRET_BYTES: usize = 64;

/// A new secret: `whsec_` and the base64 of [`SECRET_BYTES`] bytes from the operating system's
/// generator.
pub fn generate_secret() -> Result<String, Error> {
    let mut bytes = [0u8; SECRET_BYTES];
    getrandom::fill(&mut bytes)
        .map_err(|e| Error::Secret(format!("the operating system's generator failed: {e}")))?;
    Ok(format!("{SECRET_PREFIX}{}", STANDARD.encode(bytes)))
}

/// The key bytes of `secret` (`whsec_` + base64 of 24 to 64 bytes), or why it is refused.
pub fn secret_key(secret: &str) -> Result<Vec<u8>, Error> {
    let encoded = secret
        .strip_prefix(SECRET_PREFIX)
        .ok_or_else(|| Error::Secret(format!("a secret starts with {SECRET_PREFIX}")))?;
    let key = STANDARD
        .decode(encoded)
        .map_err(|_| Error::Secret("a secret's part after whsec_ is base64".into()))?;
    if !(MIN_SECRET_BYTES..=MAX_SECRET_BYTES).contains(&key.len()) {
        return Err(Error::Secret(format!(
            "a secret carries {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes, not {}",
            key.len()
        )));
    }
    Ok(key)
}

/// One signature: `v1,` and the base64 of HMAC-SHA256 keyed by `key` over
/// `{id}.{timestamp}.{body}`, the body byte for byte as sent.
pub fn sign(key: &[u8], id: &str, timestamp: i64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
}

/// The `webhook-signature` header's value: one signature per secret, space-separated.
pub fn signature_header(
    secrets: &[&str],
    id: &str,
    timestamp: i64,
    body: &[u8],
) -> Result<String, Error> {
    let mut signatures = Vec::with_capacity(secrets.len());
    for secret in secrets {
        signatures.push(sign(&secret_key(secret)?, id, timestamp, body));
    }
    Ok(signatures.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example of the standard-webhooks reference libraries' tests (the secret, id,
    /// timestamp, body and signature they check).
    #[test]
    fn signs_as_the_reference_libraries_do() {
        let key = secret_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let signature = sign(
            &key,
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            br#"{"test": 2432232314}"#,
        );
        assert_eq!(signature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn a_generated_secret_reads_back_with_its_bytes() {
        let secret = generate_secret().unwrap();
        assert!(secret.starts_with(SECRET_PREFIX));
        assert_eq!(secret_key(&secret).unwrap().len(), SECRET_BYTES);
        assert_ne!(secret, generate_secret().unwrap());
    }

    #[test]
    fn short_or_malformed_secrets_are_refused() {
        assert!(secret_key("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").is_err());
        assert!(secret_key("whsec_not base64!").is_err());
        assert!(secret_key(&format!("whsec_{}", STANDARD.encode([7u8; 16]))).is_err());
    }

    #[test]
    fn a_rotation_sends_both_signatures() {
        let (a, b) = (generate_secret().unwrap(), generate_secret().unwrap());
        let header = signature_header(&[&a, &b], "msg_1", 1, b"{}").unwrap();
        let parts: Vec<&str> = header.split(' ').collect();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0], sign(&secret_key(&a).unwrap(), "msg_1", 1, b"{}"));
        assert_eq!(parts[1], sign(&secret_key(&b).unwrap(), "msg_1", 1, b"{}"));
    }
}
