//! The fake's embedding model that embeds similar texts similarly, for the response
//! cache's demo and its false-hit bench (`benches/cache_false_hits.rs`): a model whose
//! name contains `similar` (e.g. `fake-embed-similar`) answers `/v1/embeddings` with
//! [`embedding`]; every other model keeps the eight numbers that only tell equal
//! texts apart.
//!
//! It is a bag of character trigrams, not a language model: texts that share their
//! words' spellings are close, whatever they mean. "What is 2+2" and "What is 2+3" are
//! nearer than two paraphrases in other words, which is what the cache's guard is for.
//! Character trigrams were chosen over words and word bigrams on the labelled pairs of
//! `benches/cache-pairs.jsonl`: both rank near misses above paraphrases, trigrams a
//! little less often (the share of (paraphrase, near miss) pairs ordered right: 11.3%
//! against 8.4%), and they bring inflections ("capital", "capitale") together.

/// The length of a `similar` model's embeddings.
pub const DIMENSIONS: usize = 256;

/// Whether a model of this name embeds with [`embedding`].
pub fn chosen_by(model: &str) -> bool {
    model.contains("similar")
}

/// `text` as a unit vector of [`DIMENSIONS`] numbers: the trigrams of its words
/// (lower-cased, accents removed, each padded with a space at both ends: "eau" gives
/// " ea", "eau", "au ") hashed into the dimensions with FNV-1a, a hash bit choosing
/// the sign of each count. A text without a word embeds as zeros.
pub fn embedding(text: &str) -> Vec<f32> {
    let mut vector = vec![0f32; DIMENSIONS];
    let folded = fold(text);
    for word in folded.split(|c: char| !c.is_alphanumeric()).filter(|w| !w.is_empty()) {
        let padded: Vec<char> = std::iter::once(' ').chain(word.chars()).chain(std::iter::once(' ')).collect();
        for trigram in padded.windows(3) {
            let hash = trigram.iter().fold(0xcbf2_9ce4_8422_2325_u64, |hash, c| {
                let mut bytes = [0u8; 4];
                c.encode_utf8(&mut bytes)
                    .bytes()
                    .fold(hash, |hash, byte| (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3))
            });
            let sign = if hash >> 63 == 1 { 1.0 } else { -1.0 };
            vector[(hash % DIMENSIONS as u64) as usize] += sign;
        }
    }
    let norm = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        vector.iter_mut().for_each(|x| *x /= norm);
    }
    vector
}

/// `text` lower-cased, the accents of Latin letters removed.
fn fold(text: &str) -> String {
    let mut folded = String::with_capacity(text.len());
    for c in text.chars().flat_map(char::to_lowercase) {
        match c {
            'à' | 'á' | 'â' | 'ã' | 'ä' | 'å' => folded.push('a'),
            'ç' => folded.push('c'),
            'è' | 'é' | 'ê' | 'ë' => folded.push('e'),
            'ì' | 'í' | 'î' | 'ï' => folded.push('i'),
            'ñ' => folded.push('n'),
            'ò' | 'ó' | 'ô' | 'õ' | 'ö' => folded.push('o'),
            'ù' | 'ú' | 'û' | 'ü' => folded.push('u'),
            'ý' | 'ÿ' => folded.push('y'),
            'œ' => folded.push_str("oe"),
            'æ' => folded.push_str("ae"),
            // Combining accents of a decomposed text.
            '\u{300}'..='\u{36f}' => {}
            c => folded.push(c),
        }
    }
    folded
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cosine(a: &str, b: &str) -> f32 {
        embedding(a).iter().zip(embedding(b)).map(|(x, y)| x * y).sum()
    }

    #[test]
    fn embeddings_are_unit_vectors_of_256() {
        let vector = embedding("Quelle est la capitale de la France ?");
        assert_eq!(vector.len(), DIMENSIONS);
        let norm: f32 = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{norm}");
        assert!(embedding(" ?! ").iter().all(|&x| x == 0.0));
    }

    #[test]
    fn case_accents_and_punctuation_do_not_matter() {
        assert_eq!(embedding("Où est l'école ?"), embedding("ou est l ecole"));
        assert_eq!(embedding("CAFÉ"), embedding("cafe\u{301}"));
    }

    #[test]
    fn texts_sharing_words_are_closer_than_unrelated_ones() {
        let near = cosine("What is the capital of France?", "Which city is the capital of France?");
        let far = cosine("What is the capital of France?", "How do I bake sourdough bread?");
        assert!(near > 0.7 && far < 0.5, "near {near}, far {far}");
    }

    #[test]
    fn only_models_named_similar_choose_it() {
        assert!(chosen_by("fake-embed-similar"));
        assert!(!chosen_by("fake-embed"));
    }
}
