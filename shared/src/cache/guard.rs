//! The false-hit guard of a semantic match (SPEC §16): the numbers and the negations
//! of a message, which two messages must share for one to answer the other.
//!
//! An embedding barely moves when one number or one `not` changes, yet the answer
//! does: "what is 2+2" must never answer "what is 2+3", nor "is it safe" answer "is it
//! not safe". [`of`] reduces a message to what it says in numbers and negations and
//! hashes that; a store only compares entries whose guard equals the probe's. Two
//! messages that differ there are a miss, never a hit. The reading errs towards a
//! miss: when a word is ambiguous it counts.
//!
//! What it reads, case- and accent-folded, punctuation aside, in English and French:
//! - **Numbers**, in order of appearance, each by its value: digits and number words
//!   are one ("3" = "three" = "trois" = "3rd" = "third"; "twenty-one" = "vingt et un"
//!   = "21"; "quatre-vingt-dix-sept" = "97"; "two hundred and five" = "205").
//!   `1,000` and `1,000,000` are thousands (`1000`, `1000000`), as are `1.000.000`
//!   and `1 000` (French, with any space: a lead of one to three digits then groups
//!   of three, so `2 100 pages` is 2100 pages, the French reading); a single comma or
//!   point with other than three digits after it is a decimal mark, so `3,5` = `3.5`,
//!   and a single point is always one (`1.000` = `1`). `2.50` = `2.5`, `007` = `7`.
//!   `1.2.3` is three numbers. The French article `un`/`une` is not a number (it
//!   would be one in nearly every sentence) except inside a number (`vingt et un`,
//!   `cent un`); English `one` is. `second`/`seconde` are not read as ordinals (a
//!   unit of time more often than not); `cent` is the French hundred. `half`,
//!   `demi` and `moitié` are 0.5.
//! - **Operators** next to a number: `+ - * × / ÷ ^ = < > % ≤ ≥ ≠`, and the words
//!   `percent`, `pour cent` after a number (`%`), `plus`, `minus`, `times`, `multiplied by`, `divided by`, `over`, `moins`, `fois`,
//!   `multiplié par`, `divisé par` between two numbers ("2+2" is not "2×2", "-5" is not "5").
//! - **Negations**, counted: `not` and every `n't` contraction, `no` (but `no one` is
//!   one negation, not a number), `never`, `without`, `none`, `nothing`, `nobody`,
//!   `nowhere`, `neither`, `nor`, `cannot`; `non`, `pas`, `jamais`, `sans`, `aucun(e)`,
//!   `rien`, `ni`, `guère`, `nullement`. French `ne`/`n'` does not count by itself
//!   (spoken French drops it, and `ne … que` means "only"): the word that completes
//!   it does. `personne` counts only as "nobody" (`ne` before it, or `personne ne`,
//!   and no article before it), and `plus` only as "no longer" (an open `ne` before
//!   it in the sentence, no `pas` in between); otherwise they mean "a person" and
//!   "more". Contractions without their apostrophe (`dont`, `cant`) are not read.
//!
//! Pure and allocation-light: one folded copy of the message and its tokens, no
//! regular expressions.

use super::sha256;

/// The guard of `message`: the first 8 bytes of the SHA-256 of its [`canonical`] form.
pub fn of(message: &str) -> u64 {
    let digest = sha256(canonical(message).as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

/// What [`of`] hashes: the numbers and operators in order, then the negation count,
/// e.g. `2 + 2 ; neg 1`. For tests and an operator's own checks; it holds a prompt's
/// numbers, so it is never logged.
pub fn canonical(message: &str) -> String {
    let tokens = tokens(&fold(message));
    let mut reader = Reader::default();
    reader.read(&tokens);
    format!("{} ; neg {}", reader.items.join(" "), reader.negations)
}

/// `text` lower-cased, accents removed, apostrophes and the typographic spaces of
/// French numbers unified.
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
            'ß' => folded.push_str("ss"),
            '’' | '‘' | 'ʼ' | '`' | '´' => folded.push('\''),
            '\u{a0}' | '\u{202f}' | '\u{2009}' => folded.push(NBSP),
            '−' | '–' => folded.push('-'),
            // Combining accents of a decomposed text (NFD).
            '\u{300}'..='\u{36f}' => {}
            c => folded.push(c),
        }
    }
    folded
}

/// The one space that may group the digits of a number (French `1 000`).
const NBSP: char = '\u{a0}';

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Word(String),
    /// A number written in digits, canonical (`1000`, `3.5`).
    Number(String),
    /// An operator symbol, canonical (`*` for `×`, `/` for `÷`).
    Op(char),
    /// Punctuation that ends a number written in words, not a sentence.
    Break,
    /// The end of a sentence (a French `ne` does not reach past it).
    End,
}

fn tokens(text: &str) -> Vec<Token> {
    let chars: Vec<char> = text.chars().collect();
    let at = |i: usize| chars.get(i).copied().unwrap_or(' ');
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_ascii_digit() {
            let start = i;
            loop {
                while at(i).is_ascii_digit() {
                    i += 1;
                }
                // `1 000 000`: a lead of one to three digits, then groups of three.
                let lead = chars[start..i].iter().take_while(|c| c.is_ascii_digit()).count();
                let grouped = matches!(at(i), ' ' | NBSP)
                    && lead <= 3
                    && chars[start..i].iter().all(|&c| c.is_ascii_digit() || c == ' ' || c == NBSP)
                    && (1..=3).all(|k| at(i + k).is_ascii_digit())
                    && !at(i + 4).is_ascii_digit();
                if (matches!(at(i), '.' | ',') && at(i + 1).is_ascii_digit()) || grouped {
                    i += 1;
                } else {
                    break;
                }
            }
            let literal: String = chars[start..i].iter().collect();
            tokens.extend(numbers(&literal).into_iter().map(Token::Number));
        } else if c.is_alphabetic() {
            let start = i;
            while at(i).is_alphabetic() || (at(i) == '\'' && i > start && at(i + 1).is_alphabetic()) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            words(&word, &mut tokens);
        } else {
            i += 1;
            match c {
                // A hyphen between letters joins words ("twenty-one", "dix-sept").
                '-' if i >= 2 && at(i - 2).is_alphabetic() && at(i).is_alphabetic() => {}
                '-' | '+' | '*' | '/' | '^' | '=' | '<' | '>' | '%' | '≤' | '≥' | '≠' => {
                    tokens.push(Token::Op(c))
                }
                '×' => tokens.push(Token::Op('*')),
                '÷' => tokens.push(Token::Op('/')),
                '.' | '!' | '?' | ';' | ':' | '\n' | '¿' | '¡' => tokens.push(Token::End),
                // Quotes around or inside a word do not split a number from its words.
                '\'' | '"' => {}
                c if c.is_whitespace() || c == NBSP => {}
                _ => tokens.push(Token::Break),
            }
        }
    }
    tokens
}

/// The words of `word`, split at its apostrophes: an English `n't` is a `not`, a
/// French `n'` a `ne`.
fn words(word: &str, tokens: &mut Vec<Token>) {
    if let Some(stem) = word.strip_suffix("n't") {
        if !stem.is_empty() {
            tokens.push(Token::Word(stem.to_owned()));
        }
        tokens.push(Token::Word("not".to_owned()));
        return;
    }
    for part in word.split('\'') {
        tokens.push(Token::Word(if part == "n" { "ne".to_owned() } else { part.to_owned() }));
    }
}

/// The numbers of a literal of digits, points, commas and grouping spaces.
fn numbers(literal: &str) -> Vec<String> {
    let literal: String = literal.chars().filter(|&c| c != NBSP && c != ' ').collect();
    let groups: Vec<&str> = literal.split(['.', ',']).collect();
    let seps: Vec<char> = literal.chars().filter(|c| matches!(c, '.' | ',')).collect();
    let lead = groups.first().map_or(0, |g| g.len());
    let thousands = |seps: &[char], groups: &[&str]| {
        (1..=3).contains(&lead)
            && groups[0] != "0"
            && seps.iter().all(|&s| s == seps[0])
            && groups[1..].iter().all(|g| g.len() == 3)
    };
    match seps.as_slice() {
        [] => vec![value(&literal, "")],
        [','] if thousands(&seps, &groups) => vec![value(&groups.concat(), "")],
        [_] => vec![value(groups[0], groups[1])],
        _ if thousands(&seps, &groups) => vec![value(&groups.concat(), "")],
        // `1,234.5`, `1.234,5`: grouped thousands, then a decimal mark of the other kind.
        [first @ .., last]
            if first.iter().all(|s| s == &first[0] && s != last) && thousands(first, &groups[..groups.len() - 1]) =>
        {
            vec![value(&groups[..groups.len() - 1].concat(), groups[groups.len() - 1])]
        }
        // A version, an address, a list without spaces: each group a number.
        _ => groups.iter().map(|g| value(g, "")).collect(),
    }
}

/// `whole.fraction` without leading zeros in its whole part nor trailing ones in its
/// fraction.
fn value(whole: &str, fraction: &str) -> String {
    let whole = whole.trim_start_matches('0');
    let fraction = fraction.trim_end_matches('0');
    match (whole.is_empty(), fraction.is_empty()) {
        (true, true) => "0".to_owned(),
        (_, true) => whole.to_owned(),
        (true, false) => format!("0.{fraction}"),
        (false, false) => format!("{whole}.{fraction}"),
    }
}

/// What a number word adds to the number being read.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Part {
    /// 0 to 99 (units, teens, tens, and their ordinals).
    Unit(u64),
    /// `hundred`, `cent`.
    Hundred,
    /// `thousand`, `mille`, `million`, `billion`, `milliard`.
    Scale(u64),
}

fn number_word(word: &str) -> Option<Part> {
    let unit = match word {
        "zero" => 0,
        "one" | "first" | "premier" | "premiere" | "unieme" => 1,
        "two" | "deux" | "deuxieme" => 2,
        "three" | "third" | "trois" | "troisieme" => 3,
        "four" | "fourth" | "quatre" | "quatrieme" => 4,
        "five" | "fifth" | "cinq" | "cinquieme" => 5,
        "six" | "sixth" | "sixieme" => 6,
        "seven" | "seventh" | "sept" | "septieme" => 7,
        "eight" | "eighth" | "huit" | "huitieme" => 8,
        "nine" | "ninth" | "neuf" | "neuvieme" => 9,
        "ten" | "tenth" | "dix" | "dixieme" => 10,
        "eleven" | "eleventh" | "onze" | "onzieme" => 11,
        "twelve" | "twelfth" | "douze" | "douzieme" | "dozen" | "douzaine" => 12,
        "thirteen" | "thirteenth" | "treize" | "treizieme" => 13,
        "fourteen" | "fourteenth" | "quatorze" | "quatorzieme" => 14,
        "fifteen" | "fifteenth" | "quinze" | "quinzieme" => 15,
        "sixteen" | "sixteenth" | "seize" | "seizieme" => 16,
        "seventeen" | "seventeenth" => 17,
        "eighteen" | "eighteenth" => 18,
        "nineteen" | "nineteenth" => 19,
        "twenty" | "twentieth" | "vingt" | "vingts" | "vingtieme" => 20,
        "thirty" | "thirtieth" | "trente" | "trentieme" => 30,
        "forty" | "fortieth" | "quarante" | "quarantieme" => 40,
        "fifty" | "fiftieth" | "cinquante" | "cinquantieme" => 50,
        "sixty" | "sixtieth" | "soixante" | "soixantieme" => 60,
        "seventy" | "seventieth" | "septante" => 70,
        "eighty" | "eightieth" | "octante" | "huitante" => 80,
        "ninety" | "ninetieth" | "nonante" => 90,
        "hundred" | "hundreds" | "hundredth" | "cent" | "cents" | "centieme" => return Some(Part::Hundred),
        "thousand" | "thousands" | "thousandth" | "mille" | "milliers" | "millieme" => {
            return Some(Part::Scale(1_000));
        }
        "million" | "millions" | "millionth" | "millionieme" => return Some(Part::Scale(1_000_000)),
        "billion" | "billions" | "milliard" | "milliards" => return Some(Part::Scale(1_000_000_000)),
        _ => return None,
    };
    Some(Part::Unit(unit))
}

/// A number being read from words: `total` of the scales passed, `current` below them.
#[derive(Debug, Clone, Copy, Default)]
struct Words {
    total: u64,
    current: u64,
}

impl Words {
    fn start(part: Part) -> Words {
        match part {
            Part::Unit(v) => Words { total: 0, current: v },
            Part::Hundred => Words { total: 0, current: 100 },
            Part::Scale(s) => Words { total: s, current: 0 },
        }
    }

    /// The number with `part` added, if `part` continues it.
    fn join(self, part: Part) -> Option<Words> {
        let Words { total, current } = self;
        let rest = current % 100;
        match part {
            Part::Unit(20) if rest == 4 => Some(Words { current: current + 76, ..self }),
            Part::Unit(v) => {
                let after_scale = current == 0 && total > 0;
                let after_hundred = current > 0 && rest == 0 && v < 100;
                let after_tens = rest >= 20 && rest % 10 == 0 && (1..=9).contains(&v);
                let french_teens = matches!(rest, 60 | 80) && (10..=19).contains(&v);
                let dix_sept = rest == 10 && (7..=9).contains(&v);
                (after_scale || after_hundred || after_tens || french_teens || dix_sept)
                    .then_some(Words { current: current + v, ..self })
            }
            Part::Hundred if (1..100).contains(&current) => Some(Words { current: current * 100, ..self }),
            Part::Hundred if current == 0 && total > 0 => Some(Words { current: 100, ..self }),
            Part::Hundred => None,
            Part::Scale(s) => (current > 0 && total % s.saturating_mul(1000) == 0)
                .then(|| Words { total: total.saturating_add(current.saturating_mul(s)), current: 0 }),
        }
    }

    fn value(self) -> u64 {
        self.total.saturating_add(self.current)
    }
}

#[derive(Debug, Default)]
struct Reader {
    items: Vec<String>,
    negations: u32,
    /// A number being read from words.
    words: Option<Words>,
    /// The last token was a number (an operator word between two numbers is one).
    after_number: bool,
    /// A French `ne` waits for the word that completes it, in this sentence.
    ne: bool,
}

impl Reader {
    fn read(&mut self, tokens: &[Token]) {
        let mut i = 0;
        while i < tokens.len() {
            i += 1 + self.token(tokens, i);
        }
        self.flush();
    }

    /// Reads `tokens[i]`; how many of the tokens after it it used too.
    fn token(&mut self, tokens: &[Token], i: usize) -> usize {
        let next = tokens.get(i + 1);
        match &tokens[i] {
            Token::Word(word) => return self.word(word, tokens, i),
            Token::Number(number) => {
                self.flush();
                self.items.push(number.clone());
                self.after_number = true;
                return 0;
            }
            Token::Op(op) => {
                self.flush();
                if self.after_number || starts_number(next) {
                    self.items.push(op.to_string());
                }
            }
            Token::Break => self.flush(),
            Token::End => {
                self.flush();
                self.ne = false;
            }
        }
        self.after_number = false;
        0
    }

    fn word(&mut self, word: &str, tokens: &[Token], i: usize) -> usize {
        let next = tokens.get(i + 1);
        let next_word = match next {
            Some(Token::Word(w)) => w.as_str(),
            _ => "",
        };
        if matches!(word, "half" | "demi" | "moitie") {
            self.flush();
            self.items.push("0.5".to_owned());
            self.after_number = true;
            return 0;
        }
        // `un`/`une` only inside a number ("vingt et un", "cent un").
        let joined = match word {
            "un" | "une" => self.words.and_then(|w| w.join(Part::Unit(1))),
            _ => number_word(word).map(|part| match self.words.and_then(|w| w.join(part)) {
                Some(joined) => joined,
                None => {
                    self.flush();
                    Words::start(part)
                }
            }),
        };
        if let Some(joined) = joined {
            self.words = Some(joined);
            self.after_number = true;
            return 0;
        }
        if let Some(words) = self.words
            && matches!(word, "and" | "et")
            && number_after(next).is_some_and(|part| words.join(part).is_some())
        {
            return 0;
        }
        self.flush();
        let after_number = std::mem::take(&mut self.after_number);
        // `20 percent`, `vingt pour cent`: the `%` they stand for.
        let per_cent = matches!(word, "per" | "pour") && next_word == "cent";
        if after_number && (per_cent || matches!(word, "percent" | "pourcent")) {
            self.items.push("%".to_owned());
            return usize::from(per_cent);
        }
        if let Some(op) = operator_word(word) {
            let by = matches!(next_word, "by" | "par");
            let following = tokens.get(i + 1 + usize::from(by));
            if after_number && starts_number(following) {
                self.items.push(op.to_string());
                return usize::from(by);
            }
        }
        let previous = match i.checked_sub(1).and_then(|p| tokens.get(p)) {
            Some(Token::Word(w)) => w.as_str(),
            _ => "",
        };
        match word {
            "ne" => self.ne = true,
            "no" if next_word == "one" => {
                self.negations += 1;
                return 1;
            }
            "not" | "no" | "never" | "without" | "none" | "nothing" | "nobody" | "nowhere" | "neither" | "nor"
            | "cannot" => self.negations += 1,
            "non" | "pas" | "jamais" | "sans" | "aucun" | "aucune" | "rien" | "ni" | "guere" | "nullement" => {
                self.negations += 1;
                self.ne = false;
            }
            "personne"
                if (self.ne || next_word == "ne")
                    && !matches!(previous, "une" | "la" | "cette" | "chaque" | "toute" | "seule" | "quelle") =>
            {
                self.negations += 1;
                self.ne = false;
            }
            "plus" if self.ne && previous != "non" => {
                self.negations += 1;
                self.ne = false;
            }
            // `ne … que`: "only", not a negation.
            "que" | "qu" => self.ne = false,
            _ => {}
        }
        0
    }

    fn flush(&mut self) {
        if let Some(words) = self.words.take() {
            self.items.push(words.value().to_string());
        }
    }
}

/// The number word `token` is, `un`/`une` included (they continue a number after `et`).
fn number_after(token: Option<&Token>) -> Option<Part> {
    match token {
        Some(Token::Word(w)) if w == "un" || w == "une" => Some(Part::Unit(1)),
        Some(Token::Word(w)) => number_word(w),
        _ => None,
    }
}

/// Whether `token` begins a number: digits, or a number word other than `un`/`une`.
fn starts_number(token: Option<&Token>) -> bool {
    match token {
        Some(Token::Number(_)) => true,
        Some(Token::Word(w)) => number_word(w).is_some(),
        _ => false,
    }
}

fn operator_word(word: &str) -> Option<char> {
    match word {
        "plus" => Some('+'),
        "minus" | "moins" => Some('-'),
        "times" | "fois" | "multiplied" | "multiplie" => Some('*'),
        "divided" | "divise" | "over" => Some('/'),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pairs that must share a guard: the same numbers and negations, written otherwise.
    const SAME: &[(&str, &str)] = &[
        ("What is 2+2?", "what's 2 + 2"),
        ("What is two plus two?", "What's 2+2"),
        ("Combien font deux plus deux ?", "combien font 2 + 2"),
        ("Give me three ideas", "Suggest 3 ideas please"),
        ("Donne-moi trois idées", "Propose 3 idées"),
        ("twenty-one days", "21 days"),
        ("vingt et un jours", "21 jours"),
        ("quatre-vingt-dix-sept euros", "97 €"),
        ("soixante-dix-sept ans", "77 ans"),
        ("quatre-vingts pages", "80 pages"),
        ("dix-sept heures", "17 h"),
        ("two hundred and five pages", "205 pages"),
        ("deux cent cinq pages", "205 pages"),
        ("one thousand two hundred", "1,200"),
        ("mille deux cents", "1\u{a0}200"),
        ("three million", "3,000,000"),
        ("trois millions", "3.000.000"),
        ("1,000 users", "1000 users"),
        ("1,234.5", "1.234,5"),
        ("3.5 kg", "3,5 kg"),
        ("2.50 dollars", "2.5 dollars"),
        ("the 3rd chapter", "the third chapter"),
        ("le 3e chapitre", "le troisième chapitre"),
        ("the first step", "step 1"),
        ("la première étape", "étape 1"),
        ("the capital of France", "France's capital city"),
        ("la capitale de la France", "quelle est la capitale française"),
        ("How do I cook rice?", "how to cook rice"),
        ("Comment cuire du riz ?", "comment faire cuire le riz"),
        ("Un chat noir", "Le chat noir"),
        ("Why isn't it working?", "why is it not working"),
        ("I can't log in", "I cannot log in"),
        ("I don't want sugar", "no sugar for me"),
        ("Pourquoi ça ne marche pas ?", "pourquoi ça marche pas"),
        ("Je n'ai jamais vu ça", "j'ai jamais vu ça"),
        ("Je ne mange plus de viande", "je mange jamais de viande"),
        ("un café sans sucre", "un café, pas de sucre"),
        ("Personne n'est venu", "aucun invité n'est venu"),
        ("Je ne vois personne", "Je ne vois rien"),
        ("Je n'ai que deux euros", "j'ai seulement 2 euros"),
        ("I want more sugar", "Je veux plus de sucre"),
        ("no one came", "nobody came"),
        ("CAFÉ SANS SUCRE", "cafe sans sucre"),
        ("cafe\u{301} sans sucre", "café sans sucre"),
        ("Il n’est pas là", "il n'est pas là"),
        ("une personne est venue", "quelqu'un est venu"),
        ("half an hour", "0.5 hour"),
        ("une demi-heure", "0,5 heure"),
        ("10\u{2009}000 €", "10\u{a0}000 €"),
        ("10 000 €", "10000 €"),
        ("20% of 150", "twenty percent of 150"),
        ("20 % de 150", "vingt pour cent de 150"),
        ("dix mille euros", "10\u{202f}000 €"),
        ("version 1.2.3", "v1, 2, 3"),
        ("at least 3", "at least three"),
        ("au moins 3", "au minimum trois"),
    ];

    /// Pairs that must not: a number, an operator or a negation differs.
    const DIFFERENT: &[(&str, &str)] = &[
        ("What is 2+2?", "What is 2+3?"),
        ("what is 2+2", "what is 2*2"),
        ("what is 2+2", "what is 2 x 2 = 4"),
        ("Combien font deux plus deux ?", "combien font deux fois deux"),
        ("Combien font 10 moins 3 ?", "combien font 10 plus 3"),
        ("ten divided by two", "ten times two"),
        ("-5 degrees", "5 degrees"),
        ("5% tip", "5 tip"),
        ("Give me three ideas", "Give me four ideas"),
        ("Donne-moi trois idées", "donne-moi cinq idées"),
        ("twenty-one days", "twenty days"),
        ("vingt et un jours", "vingt jours"),
        ("quatre-vingt-dix-sept euros", "quatre-vingt-sept euros"),
        ("soixante-dix euros", "soixante euros"),
        ("3.5 kg", "35 kg"),
        ("3,5 kg", "3.6 kg"),
        ("1,000 users", "1 users"),
        ("en 2018 100 personnes", "en 2018100 personnes"),
        ("20 % de 150", "25 pour cent de 150"),
        ("version 1.2.3", "version 1.2.4"),
        ("from 2 to 3", "from 3 to 2"),
        ("the 3rd chapter", "the 4th chapter"),
        ("la première étape", "la deuxième étape"),
        ("in 2023", "in 2024"),
        ("en 1999", "en 1998"),
        ("un ou deux", "deux ou trois"),
        ("one cat", "two cats"),
        ("un chat", "deux chats"),
        ("un chat", "1 chat"),
        ("Is it safe?", "Is it not safe?"),
        ("Why is it working?", "Why isn't it working?"),
        ("I can log in", "I can't log in"),
        ("I want sugar", "I want no sugar"),
        ("coffee with sugar", "coffee without sugar"),
        ("I always pay", "I never pay"),
        ("Is there anything?", "Is there nothing?"),
        ("somebody came", "nobody came"),
        ("Pourquoi ça marche ?", "Pourquoi ça ne marche pas ?"),
        ("Je l'ai vu", "Je ne l'ai jamais vu"),
        ("Je mange de la viande", "Je ne mange plus de viande"),
        ("un café avec sucre", "un café sans sucre"),
        ("Quelqu'un est venu", "Personne n'est venu"),
        ("J'ai quelque chose", "Je n'ai rien"),
        ("Il a un frère", "Il n'a aucun frère"),
        ("ni chaud ni froid", "chaud et froid"),
        ("c'est vrai", "c'est pas vrai"),
        ("oui", "non"),
        ("not bad", "not not bad"),
        ("Je n'ai que deux euros", "je n'ai pas deux euros"),
        ("Je veux plus de sucre", "Je ne veux plus de sucre"),
    ];

    #[test]
    fn paraphrases_share_a_guard() {
        let apart: Vec<String> = SAME
            .iter()
            .filter(|(a, b)| of(a) != of(b))
            .map(|(a, b)| format!("{a:?} ({}) vs {b:?} ({})", canonical(a), canonical(b)))
            .collect();
        assert!(apart.is_empty(), "{apart:#?}");
    }

    #[test]
    fn a_changed_number_or_negation_changes_the_guard() {
        let together: Vec<String> = DIFFERENT
            .iter()
            .filter(|(a, b)| of(a) == of(b))
            .map(|(a, b)| format!("{a:?} vs {b:?}: both {}", canonical(a)))
            .collect();
        assert!(together.is_empty(), "{together:#?}");
    }

    #[test]
    fn numbers_are_read_by_value_in_order() {
        for (message, expected) in [
            ("what is 2+2", "2 + 2 ; neg 0"),
            ("quatre-vingt-dix-neuf", "99 ; neg 0"),
            ("nine hundred ninety-nine thousand", "999000 ; neg 0"),
            ("deux millions trois mille", "2003000 ; neg 0"),
            ("mille cent", "1100 ; neg 0"),
            ("cent un dalmatiens", "101 ; neg 0"),
            ("one, two, three", "1 2 3 ; neg 0"),
            ("two and three", "2 3 ; neg 0"),
            ("0,125", "0.125 ; neg 0"),
            ("007", "7 ; neg 0"),
            ("1.000", "1 ; neg 0"),
            ("12,345,678.90", "12345678.9 ; neg 0"),
            ("192.168.0.1", "192 168 0 1 ; neg 0"),
            ("10km in 1h", "10 1 ; neg 0"),
            ("il y a un chat", " ; neg 0"),
            ("deux cent cinquante-trois mille quatre cent douze", "253412 ; neg 0"),
            ("1.234.567,89", "1234567.89 ; neg 0"),
            ("5-3", "5 - 3 ; neg 0"),
            // Stray punctuation and apostrophes neither panic nor invent a number.
            ("....,,,1,,2..3 --- ' n't '' n' '", "1 2 3 - ; neg 1"),
            ("999999999999 billion billion", "999999999999 1000000000 1000000000 ; neg 0"),
        ] {
            assert_eq!(canonical(message), expected, "{message:?}");
        }
    }

    #[test]
    fn negations_are_counted_once_each() {
        for (message, count) in [
            ("I don't know", 1),
            ("je ne sais pas", 1),
            ("je sais pas", 1),
            ("je ne sais que ça", 0),
            ("il n'y a plus de pain", 1),
            ("il n'y a pas plus de pain", 1),
            ("plus de pain", 0),
            ("moi non plus", 1),
            ("personne ne sait", 1),
            ("une personne sait", 0),
            ("no one knows", 1),
            ("neither here nor there", 2),
            ("won't you come", 1),
            ("Il n'est pas venu. Plus tard, il est venu", 1),
        ] {
            assert_eq!(canonical(message), format!(" ; neg {count}"), "{message:?}");
        }
    }

    #[test]
    fn the_guard_is_a_stable_hash_of_the_canonical_form() {
        let digest = sha256(b"2 + 2 ; neg 0");
        assert_eq!(of("2+2").to_be_bytes(), digest[..8]);
        assert_eq!(of(""), of("hello world"));
    }
}
