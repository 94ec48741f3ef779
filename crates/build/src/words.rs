//! The word rules of a Dockerfile's arguments: quotes, escapes and
//! `$variable` substitution, as the instructions that take them (`FROM`,
//! `COPY`, `ADD`, `ENV`, `ARG`, `LABEL`, `WORKDIR`, `USER`, `EXPOSE`)
//! apply them before anything runs. `RUN`, `CMD` and `ENTRYPOINT` are not
//! processed here: their shell sees the text as written.
//!
//! Written by hand: the Dockerfile parser hands over each instruction's
//! arguments as one unsplit string, and no crate implements Docker's
//! substitution rules (a subset of the shell's, with `\` or the `escape`
//! directive as the escape character).

use std::collections::BTreeMap;

/// Values substitution reads; a name that is not here reads as empty.
pub type Vars = BTreeMap<String, String>;

/// Why a word could not be processed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WordError {
    /// A quote was opened and never closed.
    #[error("unterminated {0} quote")]
    Unterminated(&'static str),
    /// `${` without its `}`.
    #[error("unterminated ${{...}} substitution")]
    UnterminatedBrace,
    /// `${}` or `${1abc}`: not a variable name.
    #[error("bad substitution {0:?}: expected a variable name")]
    BadName(String),
    /// A form of substitution this builder does not implement.
    #[error("unsupported substitution {0:?}: use $NAME, ${{NAME}}, ${{NAME:-default}} or ${{NAME:+alternative}}")]
    Unsupported(String),
    /// `${NAME:?message}` of an unset (or empty) variable.
    #[error("{name}: {message}")]
    Required {
        /// The variable.
        name: String,
        /// The message the Dockerfile gave, or a default one.
        message: String,
    },
}

/// The lexer over one argument string.
struct Lexer<'a> {
    chars: std::iter::Peekable<std::str::Chars<'a>>,
    escape: char,
    vars: &'a Vars,
}

/// Splits `text` into words at unquoted whitespace, removing quotes and
/// escapes and substituting variables. Quoted empty strings are words
/// (`""` gives one empty word); whitespace alone gives none.
pub fn split(text: &str, vars: &Vars, escape: char) -> Result<Vec<String>, WordError> {
    let mut lexer = Lexer::new(text, vars, escape);
    let mut words = Vec::new();
    loop {
        lexer.skip_spaces();
        if lexer.chars.peek().is_none() {
            return Ok(words);
        }
        words.push(lexer.word(true)?);
    }
}

/// Processes `text` as one word: quotes, escapes and substitution apply,
/// whitespace is kept as it is.
pub fn single(text: &str, vars: &Vars, escape: char) -> Result<String, WordError> {
    Lexer::new(text, vars, escape).word(false)
}

/// Splits `text` into words at unquoted whitespace without processing
/// them (quotes and escapes stay), for `ENV a=1 b="x y"`, whose pairs are
/// found first and processed one by one.
pub fn raw_split(text: &str, escape: char) -> Result<Vec<String>, WordError> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut chars = text.chars().peekable();
    let mut quote: Option<char> = None;
    let mut in_word = false;
    while let Some(c) = chars.next() {
        match quote {
            Some(q) => {
                word.push(c);
                if c == escape && q == '"' {
                    if let Some(next) = chars.next() {
                        word.push(next);
                    }
                } else if c == q {
                    quote = None;
                }
            }
            None if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            None => {
                in_word = true;
                word.push(c);
                if c == escape {
                    if let Some(next) = chars.next() {
                        word.push(next);
                    }
                } else if c == '\'' || c == '"' {
                    quote = Some(c);
                }
            }
        }
    }
    match quote {
        Some('\'') => return Err(WordError::Unterminated("single")),
        Some(_) => return Err(WordError::Unterminated("double")),
        None => {}
    }
    if in_word {
        words.push(word);
    }
    Ok(words)
}

impl<'a> Lexer<'a> {
    fn new(text: &'a str, vars: &'a Vars, escape: char) -> Self {
        Self {
            chars: text.chars().peekable(),
            escape,
            vars,
        }
    }

    fn skip_spaces(&mut self) {
        while self.chars.next_if(|c| c.is_whitespace()).is_some() {}
    }

    /// One word, up to unquoted whitespace when `stop_at_space`.
    fn word(&mut self, stop_at_space: bool) -> Result<String, WordError> {
        let mut out = String::new();
        while let Some(&c) = self.chars.peek() {
            if stop_at_space && c.is_whitespace() {
                break;
            }
            self.chars.next();
            match c {
                '\'' => self.single_quoted(&mut out)?,
                '"' => self.double_quoted(&mut out)?,
                '$' => self.dollar(&mut out)?,
                c if c == self.escape => match self.chars.next() {
                    Some(next) => out.push(next),
                    // A trailing escape stays as written.
                    None => out.push(c),
                },
                c => out.push(c),
            }
        }
        Ok(out)
    }

    fn single_quoted(&mut self, out: &mut String) -> Result<(), WordError> {
        loop {
            match self.chars.next() {
                Some('\'') => return Ok(()),
                Some(c) => out.push(c),
                None => return Err(WordError::Unterminated("single")),
            }
        }
    }

    fn double_quoted(&mut self, out: &mut String) -> Result<(), WordError> {
        loop {
            match self.chars.next() {
                Some('"') => return Ok(()),
                Some('$') => self.dollar(out)?,
                Some(c) if c == self.escape => match self.chars.next() {
                    // Inside double quotes the escape takes only what would
                    // otherwise end or expand the string.
                    Some(next) if next == '"' || next == '$' || next == self.escape => {
                        out.push(next)
                    }
                    Some(next) => {
                        out.push(c);
                        out.push(next);
                    }
                    None => return Err(WordError::Unterminated("double")),
                },
                Some(c) => out.push(c),
                None => return Err(WordError::Unterminated("double")),
            }
        }
    }

    /// After a `$`: `${...}`, `$NAME`, or a literal `$`.
    fn dollar(&mut self, out: &mut String) -> Result<(), WordError> {
        match self.chars.peek() {
            Some('{') => {
                self.chars.next();
                self.braced(out)
            }
            Some(&c) if c == '_' || c.is_ascii_alphabetic() => {
                let mut name = String::new();
                while let Some(c) = self
                    .chars
                    .next_if(|c| *c == '_' || c.is_ascii_alphanumeric())
                {
                    name.push(c);
                }
                out.push_str(self.vars.get(&name).map_or("", String::as_str));
                Ok(())
            }
            _ => {
                out.push('$');
                Ok(())
            }
        }
    }

    /// `${NAME}`, `${NAME:-word}`, `${NAME-word}`, `${NAME:+word}`,
    /// `${NAME+word}`, `${NAME:?message}`, `${NAME?message}`; the word is
    /// itself processed (quotes, escapes, substitution) only when used.
    fn braced(&mut self, out: &mut String) -> Result<(), WordError> {
        let mut name = String::new();
        while let Some(c) = self
            .chars
            .next_if(|c| *c == '_' || c.is_ascii_alphanumeric())
        {
            name.push(c);
        }
        let valid = name
            .chars()
            .next()
            .is_some_and(|c| c == '_' || c.is_ascii_alphabetic());
        // The rest up to the matching brace: nested `${...}`, quoted text
        // and escaped characters do not end it.
        let mut rest = String::new();
        let mut depth = 0usize;
        let mut quote: Option<char> = None;
        loop {
            let Some(c) = self.chars.next() else {
                return Err(WordError::UnterminatedBrace);
            };
            match (quote, c) {
                (None, '}') if depth == 0 => break,
                (Some('\''), '\'') | (Some('"'), '"') => quote = None,
                (None, '\'' | '"') => quote = Some(c),
                (Some('\''), _) => {}
                (_, c) if c == self.escape => {
                    rest.push(c);
                    match self.chars.next() {
                        Some(next) => rest.push(next),
                        None => return Err(WordError::UnterminatedBrace),
                    }
                    continue;
                }
                (None, '}') => depth -= 1,
                (None, '{') if rest.ends_with('$') => depth += 1,
                _ => {}
            }
            rest.push(c);
        }
        if !valid {
            return Err(WordError::BadName(format!("${{{name}{rest}}}")));
        }
        let value = self.vars.get(&name);
        let (colon, op, word) = match rest.strip_prefix(':') {
            Some(after) => (true, after.chars().next(), after.get(1..).unwrap_or("")),
            None => (false, rest.chars().next(), rest.get(1..).unwrap_or("")),
        };
        // With a colon an empty value counts as unset.
        let set = value.is_some_and(|v| !colon || !v.is_empty());
        let nested = |word: &str| single(word, self.vars, self.escape);
        match op {
            None if !colon => out.push_str(value.map_or("", String::as_str)),
            Some('-') if set => out.push_str(value.map_or("", String::as_str)),
            Some('-') => out.push_str(&nested(word)?),
            Some('+') if set => out.push_str(&nested(word)?),
            Some('+') => {}
            Some('?') if set => out.push_str(value.map_or("", String::as_str)),
            Some('?') => {
                let message = nested(word)?;
                return Err(WordError::Required {
                    name,
                    message: if message.is_empty() {
                        "required but not set".to_owned()
                    } else {
                        message
                    },
                });
            }
            _ => return Err(WordError::Unsupported(format!("${{{name}{rest}}}"))),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vars {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn words_split_at_unquoted_space_and_lose_their_quotes() {
        let v = vars(&[("A", "x y")]);
        assert_eq!(
            split(r#"a "b c" 'd $A' e\ f "$A" $A """#, &v, '\\').unwrap(),
            ["a", "b c", "d $A", "e f", "x y", "x y", ""]
        );
        assert_eq!(split("   ", &v, '\\').unwrap(), Vec::<String>::new());
    }

    #[test]
    fn substitution_forms() {
        let v = vars(&[("SET", "v"), ("EMPTY", "")]);
        let one = |s: &str| single(s, &v, '\\');
        assert_eq!(one("$SET/${SET}/$UNSET.").unwrap(), "v/v/.");
        assert_eq!(
            one("${UNSET:-d} ${EMPTY:-d} ${EMPTY-d} ${SET:-d}").unwrap(),
            "d d  v"
        );
        assert_eq!(
            one("${SET:+alt} ${EMPTY:+alt} ${EMPTY+alt} ${UNSET+alt}").unwrap(),
            "alt  alt "
        );
        assert_eq!(one("${UNSET:-${SET}x}").unwrap(), "vx");
        // Quoted and escaped braces belong to the word.
        assert_eq!(one(r#"${UNSET:-"}"}"#).unwrap(), "}");
        assert_eq!(one(r"${UNSET:-\}}").unwrap(), "}");
        assert_eq!(one("${UNSET:-'a}b'}").unwrap(), "a}b");
        assert_eq!(one(r"\$SET $ $1 a$").unwrap(), "$SET $ $1 a$");
        assert_eq!(one("${SET:?}").unwrap(), "v");
        assert!(
            matches!(one("${UNSET:?give it}"), Err(WordError::Required { message, .. }) if message == "give it")
        );
        assert!(matches!(one("${SET#v}"), Err(WordError::Unsupported(_))));
        assert!(matches!(one("${}"), Err(WordError::BadName(_))));
        assert!(matches!(one("${1A}"), Err(WordError::BadName(_))));
        assert_eq!(one("${SET"), Err(WordError::UnterminatedBrace));
    }

    #[test]
    fn quotes_and_escapes() {
        let v = vars(&[("A", "1")]);
        assert_eq!(
            single(r#""a\"b\$A\\c\n""#, &v, '\\').unwrap(),
            r#"a"b$A\c\n"#
        );
        assert_eq!(
            single("'unterminated", &v, '\\'),
            Err(WordError::Unterminated("single"))
        );
        assert_eq!(
            single("\"unterminated", &v, '\\'),
            Err(WordError::Unterminated("double"))
        );
        // The escape directive's backtick (Windows-style Dockerfiles).
        assert_eq!(single(r"a`$A\b", &v, '`').unwrap(), r"a$A\b");
    }

    #[test]
    fn raw_split_keeps_quotes_for_pairs() {
        assert_eq!(
            raw_split(r#"a=1 b="x y" c='p q' d=\ e"#, '\\').unwrap(),
            ["a=1", r#"b="x y""#, "c='p q'", r"d=\ e"]
        );
        assert!(raw_split("a=\"x", '\\').is_err());
    }

    proptest::proptest! {
        /// Whatever the input, processing ends with a value or an error.
        #[test]
        fn any_text_is_processed_or_refused(text in "\\PC{0,64}") {
            let v = vars(&[("A", "1")]);
            let _ = split(&text, &v, '\\');
            let _ = single(&text, &v, '\\');
            let _ = raw_split(&text, '\\');
        }
    }
}
