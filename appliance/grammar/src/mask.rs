//! The vocabulary mask: which tokens keep the output inside a grammar.
//!
//! The tokens' bytes form a trie, walked depth first from the matcher's state: a subtree is
//! dropped at the first byte the grammar refuses, so a structural position (where few bytes
//! fit) visits a handful of nodes. Free text (inside a JSON string) lets most of the
//! vocabulary through, so the matcher states met are interned and their transitions
//! remembered ([`States`]): inside a string almost every byte leads back to the same state, and
//! the walk becomes table lookups. Whole masks are kept per state as well, so the next token
//! inside the same string costs nothing.

use std::collections::HashMap;
use std::sync::Arc;

use crate::grammar::{Grammar, Matcher};

/// Index of an interned state in its [`States`].
pub type StateId = u32;

/// Interned matcher states of one grammar and the byte transitions found between them.
pub struct States {
    grammar: Arc<Grammar>,
    ids: HashMap<Matcher, StateId>,
    all: Vec<Matcher>,
    /// (state, byte) -> next state, `None` when the byte is refused.
    next: HashMap<(StateId, u8), Option<StateId>>,
}

/// Transitions remembered before the table is started afresh (a bound on memory for very
/// long or very varied outputs; about 16 bytes each).
const MAX_TRANSITIONS: usize = 1 << 21;

impl States {
    pub fn new(grammar: Arc<Grammar>) -> States {
        States {
            grammar,
            ids: HashMap::new(),
            all: Vec::new(),
            next: HashMap::new(),
        }
    }

    /// The grammar's start state.
    pub fn start(&mut self) -> StateId {
        let m = Matcher::new(&self.grammar);
        self.intern(m)
    }

    fn intern(&mut self, m: Matcher) -> StateId {
        if let Some(&id) = self.ids.get(&m) {
            return id;
        }
        let id = self.all.len() as StateId;
        self.all.push(m.clone());
        self.ids.insert(m, id);
        id
    }

    /// The state after `b`, or `None` when the grammar refuses it.
    pub fn step(&mut self, s: StateId, b: u8) -> Option<StateId> {
        if let Some(&n) = self.next.get(&(s, b)) {
            return n;
        }
        let n = self.all[s as usize]
            .after(&self.grammar, b)
            .map(|m| self.intern(m));
        self.next.insert((s, b), n);
        n
    }

    /// The state after `bytes`, or `None` when the grammar refuses one of them.
    pub fn steps(&mut self, mut s: StateId, bytes: &[u8]) -> Option<StateId> {
        for &b in bytes {
            s = self.step(s, b)?;
        }
        Some(s)
    }

    pub fn matcher(&self, s: StateId) -> &Matcher {
        &self.all[s as usize]
    }

    /// Forgets everything but state `keep`, which becomes state 0; returns its new id.
    fn reset(&mut self, keep: StateId) -> StateId {
        let m = self.all[keep as usize].clone();
        self.ids.clear();
        self.all.clear();
        self.next.clear();
        self.intern(m)
    }
}

struct Node {
    /// (byte, child index), sorted by byte.
    children: Vec<(u8, u32)>,
    /// Tokens whose bytes end here.
    tokens: Vec<u32>,
}

/// The vocabulary's byte strings as a trie, plus the end-of-generation tokens.
pub struct TokenTrie {
    nodes: Vec<Node>,
    eog: Vec<u32>,
    vocab_size: usize,
}

impl TokenTrie {
    /// A trie of `tokens` (id, bytes) out of a vocabulary of `vocab_size`; leave out control
    /// tokens and tokens with no bytes (they are never allowed). `eog` are the tokens that end
    /// a generation, allowed once the output is complete.
    pub fn new<'a>(
        tokens: impl IntoIterator<Item = (u32, &'a [u8])>,
        eog: &[u32],
        vocab_size: usize,
    ) -> TokenTrie {
        let mut nodes = vec![Node {
            children: Vec::new(),
            tokens: Vec::new(),
        }];
        for (id, bytes) in tokens {
            if bytes.is_empty() {
                continue;
            }
            let mut at = 0usize;
            for &b in bytes {
                at = match nodes[at].children.binary_search_by_key(&b, |c| c.0) {
                    Ok(i) => nodes[at].children[i].1 as usize,
                    Err(i) => {
                        nodes.push(Node {
                            children: Vec::new(),
                            tokens: Vec::new(),
                        });
                        let child = nodes.len() - 1;
                        nodes[at].children.insert(i, (b, child as u32));
                        child
                    }
                };
            }
            nodes[at].tokens.push(id);
        }
        TokenTrie {
            nodes,
            eog: eog.to_vec(),
            vocab_size,
        }
    }

    /// Every token allowed in state `s`: those whose bytes the grammar accepts, and the
    /// end-of-generation tokens when the output is complete. `allowed` is resized to the
    /// vocabulary.
    pub fn allowed(&self, states: &mut States, s: StateId, allowed: &mut Vec<bool>) {
        allowed.clear();
        allowed.resize(self.vocab_size, false);
        if states.matcher(s).is_complete() {
            for &t in &self.eog {
                if let Some(a) = allowed.get_mut(t as usize) {
                    *a = true;
                }
            }
        }
        let mut stack: Vec<(usize, StateId)> = vec![(0, s)];
        while let Some((node, state)) = stack.pop() {
            for &(b, child) in &self.nodes[node].children {
                let Some(next) = states.step(state, b) else {
                    continue;
                };
                let child = child as usize;
                for &t in &self.nodes[child].tokens {
                    if let Some(a) = allowed.get_mut(t as usize) {
                        *a = true;
                    }
                }
                if !self.nodes[child].children.is_empty() {
                    stack.push((child, next));
                }
            }
        }
    }
}

/// Masks kept per state (each one bool per vocabulary token).
const MAX_MASKS: usize = 64;

/// A generation held to a grammar: masks each step's logits and follows the sampled tokens.
pub struct Constrained {
    trie: Arc<TokenTrie>,
    states: States,
    state: StateId,
    masks: HashMap<StateId, Vec<bool>>,
}

impl Constrained {
    pub fn new(grammar: Arc<Grammar>, trie: Arc<TokenTrie>) -> Constrained {
        let mut states = States::new(grammar);
        let state = states.start();
        Constrained {
            trie,
            states,
            state,
            masks: HashMap::new(),
        }
    }

    /// Sets the logits of every token the grammar does not allow next to minus infinity.
    /// Returns whether any token is left.
    pub fn mask(&mut self, logits: &mut [f32]) -> bool {
        if self.states.next.len() > MAX_TRANSITIONS {
            self.state = self.states.reset(self.state);
            self.masks.clear();
        }
        if !self.masks.contains_key(&self.state) {
            if self.masks.len() >= MAX_MASKS {
                self.masks.clear();
            }
            let mut allowed = Vec::new();
            self.trie
                .allowed(&mut self.states, self.state, &mut allowed);
            self.masks.insert(self.state, allowed);
        }
        let allowed = &self.masks[&self.state];
        let mut any = false;
        for (i, l) in logits.iter_mut().enumerate() {
            if allowed.get(i).copied().unwrap_or(false) {
                any = true;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        any
    }

    /// Follows a sampled token's bytes; `false` when the grammar refuses them (the state is
    /// then unchanged).
    pub fn accept(&mut self, bytes: &[u8]) -> bool {
        match self.states.steps(self.state, bytes) {
            Some(s) => {
                self.state = s;
                true
            }
            None => false,
        }
    }

    /// Whether the output so far is a whole match.
    pub fn is_complete(&self) -> bool {
        self.states.matcher(self.state).is_complete()
    }

    /// Whether the output is complete and nothing may follow it (the generation is over).
    pub fn is_finished(&self) -> bool {
        !self.states.matcher(self.state).can_continue()
    }
}
