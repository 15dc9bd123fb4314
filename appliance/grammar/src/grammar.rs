//! A context-free grammar over bytes, and the matcher that follows it byte by byte.
//!
//! A rule is a list of alternatives, each a sequence of elements: a set of bytes or another
//! rule. The matcher keeps every way the bytes so far can be read (a set of stacks of grammar
//! positions, each stack's top at a byte set), so alternatives need no lookahead. Grammars must
//! not be left-recursive (the builders in this crate recurse on the right only); a reference in
//! the last place of a sequence replaces its frame instead of stacking on it, so a list of any
//! length keeps the stacks shallow.

/// Index of a rule in its [`Grammar`].
pub type RuleId = u32;

/// A set of bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct ByteSet([u64; 4]);

impl ByteSet {
    /// The bytes `lo..=hi`.
    pub fn range(lo: u8, hi: u8) -> ByteSet {
        let mut s = ByteSet::default();
        for b in lo..=hi {
            s.insert(b);
        }
        s
    }

    /// Exactly `b`.
    pub fn byte(b: u8) -> ByteSet {
        ByteSet::range(b, b)
    }

    /// Each of `bytes`.
    pub fn of(bytes: &[u8]) -> ByteSet {
        let mut s = ByteSet::default();
        for &b in bytes {
            s.insert(b);
        }
        s
    }

    pub fn insert(&mut self, b: u8) {
        self.0[usize::from(b >> 6)] |= 1 << (b & 63);
    }

    /// Every byte of `self` except those of `other`.
    pub fn minus(mut self, other: ByteSet) -> ByteSet {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a &= !b;
        }
        self
    }

    pub fn contains(&self, b: u8) -> bool {
        self.0[usize::from(b >> 6)] & (1 << (b & 63)) != 0
    }
}

/// One element of a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    /// One byte out of the set.
    Set(ByteSet),
    /// Anything the rule matches.
    Rule(RuleId),
}

/// Rules of alternatives of sequences; `root` is what a whole output must match.
#[derive(Clone, Debug, Default)]
pub struct Grammar {
    rules: Vec<Vec<Vec<Elem>>>,
    root: RuleId,
}

impl Grammar {
    /// An empty rule to be filled by [`Grammar::set_rule`] (so rules can refer to themselves).
    pub fn declare(&mut self) -> RuleId {
        self.rules.push(Vec::new());
        (self.rules.len() - 1) as RuleId
    }

    pub fn set_rule(&mut self, id: RuleId, alternatives: Vec<Vec<Elem>>) {
        self.rules[id as usize] = alternatives;
    }

    /// A new rule of `alternatives`.
    pub fn rule(&mut self, alternatives: Vec<Vec<Elem>>) -> RuleId {
        let id = self.declare();
        self.set_rule(id, alternatives);
        id
    }

    pub fn set_root(&mut self, root: RuleId) {
        self.root = root;
    }

    pub fn len(&self) -> usize {
        self.rules.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    fn seq(&self, p: Pos) -> &[Elem] {
        &self.rules[p.rule as usize][p.alt as usize]
    }
}

/// A place in a sequence: the next element to match.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Pos {
    rule: RuleId,
    alt: u32,
    idx: u32,
}

/// Every stack a matcher may hold at once; a grammar needing more is too ambiguous to follow.
const MAX_STACKS: usize = 4096;
/// Nesting a stack may reach (a schema's recursion through `$ref`, or `{}` values nested this
/// deep, stops here).
const MAX_DEPTH: usize = 256;

/// Where a grammar stands after the bytes fed so far. Two matchers are equal when they allow
/// the same continuations by the same readings (the stacks are kept sorted and unique).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Matcher {
    /// Each a way to read the bytes so far: the positions from the root down, the last at a
    /// byte set. An empty stack means the root is complete.
    stacks: Vec<Vec<Pos>>,
}

impl Matcher {
    /// At the start of `grammar`'s root.
    pub fn new(grammar: &Grammar) -> Matcher {
        let mut stacks = Vec::new();
        for alt in 0..grammar.rules[grammar.root as usize].len() {
            let pos = Pos {
                rule: grammar.root,
                alt: alt as u32,
                idx: 0,
            };
            settle(grammar, vec![pos], &mut stacks);
        }
        Matcher {
            stacks: dedup(stacks),
        }
    }

    /// Feeds one byte; `false` (and the matcher unchanged) when the grammar does not allow it.
    pub fn accept(&mut self, grammar: &Grammar, b: u8) -> bool {
        match self.after(grammar, b) {
            Some(m) => {
                *self = m;
                true
            }
            None => false,
        }
    }

    /// Feeds `bytes`; `false` (and the matcher unchanged) unless the grammar allows all of them.
    pub fn accept_bytes(&mut self, grammar: &Grammar, bytes: &[u8]) -> bool {
        let mut m = self.clone();
        for &b in bytes {
            if !m.accept(grammar, b) {
                return false;
            }
        }
        *self = m;
        true
    }

    /// The matcher after `b`, or `None` when the grammar does not allow it.
    pub fn after(&self, grammar: &Grammar, b: u8) -> Option<Matcher> {
        let mut next = Vec::new();
        for stack in &self.stacks {
            let Some(&top) = stack.last() else { continue };
            let Elem::Set(set) = grammar.seq(top)[top.idx as usize] else {
                unreachable!("a settled stack's top is a byte set")
            };
            if set.contains(b) {
                let mut s = stack.clone();
                if let Some(t) = s.last_mut() {
                    t.idx += 1;
                }
                settle(grammar, s, &mut next);
                if next.len() > MAX_STACKS {
                    return None;
                }
            }
        }
        if next.is_empty() {
            None
        } else {
            Some(Matcher {
                stacks: dedup(next),
            })
        }
    }

    /// Whether the bytes so far are a whole match of the root.
    pub fn is_complete(&self) -> bool {
        self.stacks.iter().any(Vec::is_empty)
    }

    /// Whether some byte may still follow.
    pub fn can_continue(&self) -> bool {
        self.stacks.iter().any(|s| !s.is_empty())
    }
}

/// Moves `stack` forward until its top is a byte set (expanding rules, popping finished
/// sequences), pushing each result to `out`; a stack that pops its root is complete (empty).
fn settle(grammar: &Grammar, stack: Vec<Pos>, out: &mut Vec<Vec<Pos>>) {
    let mut work = vec![stack];
    while let Some(mut stack) = work.pop() {
        loop {
            let Some(&top) = stack.last() else {
                out.push(stack);
                break;
            };
            let seq = grammar.seq(top);
            if top.idx as usize == seq.len() {
                stack.pop();
                if let Some(parent) = stack.last_mut() {
                    parent.idx += 1;
                }
                continue;
            }
            match seq[top.idx as usize] {
                Elem::Set(_) => {
                    out.push(stack);
                    break;
                }
                Elem::Rule(r) => {
                    let tail = top.idx as usize + 1 == seq.len();
                    if tail {
                        // The caller's sequence ends with this reference: the callee takes its
                        // place, so the callee finishing advances the caller's caller.
                        stack.pop();
                    }
                    if stack.len() >= MAX_DEPTH {
                        break;
                    }
                    let alts = grammar.rules[r as usize].len();
                    for alt in (0..alts).rev() {
                        let mut s = if alt == 0 {
                            std::mem::take(&mut stack)
                        } else {
                            stack.clone()
                        };
                        s.push(Pos {
                            rule: r,
                            alt: alt as u32,
                            idx: 0,
                        });
                        work.push(s);
                    }
                    break;
                }
            }
        }
        if out.len() > MAX_STACKS {
            return;
        }
    }
}

/// Sorted and unique: the canonical form, so equal states compare and hash equal.
fn dedup(mut stacks: Vec<Vec<Pos>>) -> Vec<Vec<Pos>> {
    stacks.sort_unstable();
    stacks.dedup();
    stacks
}
