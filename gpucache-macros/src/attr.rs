//! Parsing of the macros' input, and every misuse error. Errors are spanned on the user's tokens
//! (or on the macro call when there are none) and say what to write instead.

use proc_macro2::{Delimiter, Span, TokenStream, TokenTree};
use quote::{ToTokens, quote};
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream};
use syn::{Expr, ExprClosure, Ident, Item, ItemFn, LitStr, Path, Token, TraitItemFn};

/// Which macro is being parsed, for the error messages.
#[derive(Clone, Copy)]
enum Form {
    Attribute,
    Block,
}

impl Form {
    fn macro_name(self) -> &'static str {
        match self {
            Form::Attribute => "`#[cache_scope]`",
            Form::Block => "`cache_scope!`",
        }
    }

    /// How the macro is written.
    fn usage(self) -> &'static str {
        match self {
            Form::Attribute => "`#[cache_scope(name)]` or `#[cache_scope(\"name\")]`",
            Form::Block => {
                "`cache_scope!(name, { ... })`, `cache_scope!(\"name\", expr)` or, for a name \
                 computed at run time, `cache_scope!(name = <expr>, { ... })`"
            }
        }
    }

    /// How the macro is written with the scope name `name` as a string literal.
    fn with_string(self, name: &str) -> String {
        match self {
            Form::Attribute => format!("`#[cache_scope({name:?})]`"),
            Form::Block => format!("`cache_scope!({name:?}, {{ ... }})`"),
        }
    }
}

/// A scope name: an identifier (its text, `r#` removed) or a non-empty string literal.
pub(crate) struct ScopeName {
    text: String,
    span: Span,
}

impl ScopeName {
    /// The name as a string literal spanned on the user's name.
    pub(crate) fn lit(&self) -> LitStr {
        LitStr::new(&self.text, self.span)
    }

    fn parse(input: ParseStream<'_>, form: Form) -> syn::Result<Self> {
        if input.is_empty() {
            return Err(syn::Error::new(
                Span::call_site(),
                format!("missing scope name: write {}", form.usage()),
            ));
        }
        reject_option(input, form)?;
        if input.peek(Ident::peek_any) && input.peek2(Token![::]) {
            let path = input.call(Path::parse_mod_style)?;
            let text = path.to_token_stream().to_string().replace(' ', "");
            return Err(syn::Error::new_spanned(
                path,
                format!(
                    "a scope name is an identifier or a string literal, not a path: write {}",
                    form.with_string(&text)
                ),
            ));
        }
        if input.peek(LitStr) {
            let lit: LitStr = input.parse()?;
            if !lit.suffix().is_empty() {
                return Err(syn::Error::new_spanned(
                    &lit,
                    format!(
                        "unexpected suffix `{}` on the scope name: write {}",
                        lit.suffix(),
                        form.with_string(&lit.value())
                    ),
                ));
            }
            let text = lit.value();
            if text.is_empty() {
                return Err(syn::Error::new_spanned(
                    &lit,
                    format!("the scope name must not be empty: write {}", form.usage()),
                ));
            }
            return Ok(ScopeName {
                text,
                span: lit.span(),
            });
        }
        if input.peek(Ident::peek_any) {
            let ident = input.call(Ident::parse_any)?;
            return Ok(ScopeName {
                text: ident.unraw().to_string(),
                span: ident.span(),
            });
        }
        Err(input.error(format!(
            "expected a scope name (an identifier or a string literal): write {}",
            form.usage()
        )))
    }
}

/// Whether `input` starts with `key =` (and not `key ==`).
fn peek_key(input: ParseStream<'_>) -> bool {
    input.peek(Ident::peek_any) && input.peek2(Token![=]) && !input.peek2(Token![==])
}

/// Fails on `key = value`, which reads like an option; `cache_scope` has none. (The block
/// macro's `name = <expr>` is parsed before this is called.)
fn reject_option(input: ParseStream<'_>, form: Form) -> syn::Result<()> {
    if !peek_key(input) {
        return Ok(());
    }
    let key = input.call(Ident::parse_any)?;
    let message = match form {
        Form::Attribute if key == "name" => format!(
            "`#[cache_scope]` takes a name written in the code, not `name = ...`: write {}; for \
             a name computed at run time, use `cache_scope!(name = <expr>, {{ ... }})` inside \
             the function",
            form.usage()
        ),
        _ => format!(
            "unknown option `{key}`: {} takes only a scope name (a cache's options are set with \
             `gpucache::configure`): write {}",
            form.macro_name(),
            form.usage()
        ),
    };
    Err(syn::Error::new_spanned(&key, message))
}

/// Fails on whatever is left in `input`, underlining all of it.
fn reject_rest(input: ParseStream<'_>, form: Form, message: &str) -> syn::Result<()> {
    if input.is_empty() {
        return Ok(());
    }
    reject_option(input, form)?;
    let rest: TokenStream = input.parse()?;
    Err(syn::Error::new_spanned(rest, message))
}

/// The arguments of `#[cache_scope(...)]`: one scope name and an optional trailing comma.
pub(crate) struct AttrArgs {
    pub(crate) name: ScopeName,
}

impl Parse for AttrArgs {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let form = Form::Attribute;
        let name = ScopeName::parse(input, form)?;
        if input.peek(Token![,]) {
            input.parse::<Token![,]>()?;
        }
        let message = format!(
            "{} takes exactly one scope name: write {}",
            form.macro_name(),
            form.usage()
        );
        reject_rest(input, form, &message)?;
        Ok(AttrArgs { name })
    }
}

/// The name of a `cache_scope!`: written in the code, or computed at run time.
pub(crate) enum BlockName {
    /// `cache_scope!(name, ..)` or `cache_scope!("name", ..)`.
    Fixed(ScopeName),
    /// `cache_scope!(name = <expr>, ..)`: the expression, as the user wrote it.
    Computed(Expr),
}

impl BlockName {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let form = Form::Block;
        let is_name_key = input
            .fork()
            .call(Ident::parse_any)
            .is_ok_and(|key| key == "name");
        if !(is_name_key && peek_key(input)) {
            return ScopeName::parse(input, form).map(BlockName::Fixed);
        }
        let key = input.call(Ident::parse_any)?;
        let eq: Token![=] = input.parse()?;
        if input.is_empty() || input.peek(Token![,]) {
            return Err(syn::Error::new_spanned(
                quote!(#key #eq),
                "missing expression after `name =`: write `cache_scope!(name = <expr>, { ... })`, \
                 where the expression gives the scope name (a `&str`, a `String`, anything \
                 `AsRef<str>`)",
            ));
        }
        input.parse().map(BlockName::Computed)
    }

    /// An error that points at the name.
    fn error(&self, message: String) -> syn::Error {
        match self {
            BlockName::Fixed(name) => syn::Error::new(name.span, message),
            BlockName::Computed(expr) => syn::Error::new_spanned(expr, message),
        }
    }
}

/// The input of `cache_scope!(name, body)`; a trailing comma is allowed.
pub(crate) struct BlockArgs {
    pub(crate) name: BlockName,
    pub(crate) body: Expr,
}

impl Parse for BlockArgs {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let form = Form::Block;
        let usage = form.usage();
        if input.is_empty() {
            return Err(syn::Error::new(
                Span::call_site(),
                format!("missing scope name and body: write {usage}"),
            ));
        }
        let name = BlockName::parse(input)?;
        if input.is_empty() {
            return Err(name.error(format!("missing body after the scope name: write {usage}")));
        }
        if !input.peek(Token![,]) {
            return Err(input.error(format!(
                "expected `,` between the scope name and the body: write {usage}"
            )));
        }
        let comma: Token![,] = input.parse()?;
        if input.is_empty() {
            return Err(syn::Error::new_spanned(
                comma,
                format!("missing body after `,`: write {usage}"),
            ));
        }
        let body: Expr = input.parse()?;
        if let Expr::Closure(closure) = &body {
            let ExprClosure {
                asyncness,
                capture,
                or1_token,
                inputs,
                or2_token,
                ..
            } = closure;
            return Err(syn::Error::new_spanned(
                quote!(#asyncness #capture #or1_token #inputs #or2_token),
                "the body of `cache_scope!` is a closure, so the scope would be active only while \
                 the closure is created, not when it runs: put `cache_scope!` inside the closure \
                 body, or use `#[cache_scope(name)]` on a function",
            ));
        }
        if input.peek(Token![,]) {
            input.parse::<Token![,]>()?;
        }
        if !input.is_empty() {
            let rest: TokenStream = input.parse()?;
            return Err(syn::Error::new_spanned(
                rest,
                format!(
                    "unexpected input after the body: `cache_scope!` takes a scope name and one \
                     body; write {usage}"
                ),
            ));
        }
        Ok(BlockArgs { name, body })
    }
}

/// Parses the item under `#[cache_scope]`: a function (free, method, associated, `unsafe`,
/// `async`, generic) with a body, and not `const`.
pub(crate) fn parse_fn(item: TokenStream) -> syn::Result<ItemFn> {
    let parsed = syn::parse2::<Item>(item.clone())?;
    match parsed {
        Item::Fn(func) => {
            if let Some(constness) = &func.sig.constness {
                return Err(syn::Error::new_spanned(
                    constness,
                    "`#[cache_scope]` cannot be used on a `const fn`: entering a scope is a \
                     run-time effect; remove `const`, or use `cache_scope!(name, { ... })` \
                     where the function is called at run time",
                ));
            }
            Ok(func)
        }
        Item::Verbatim(tokens) => match syn::parse2::<TraitItemFn>(tokens) {
            Ok(decl) if decl.default.is_none() => Err(syn::Error::new_spanned(
                &decl.sig,
                "`#[cache_scope]` needs a function body: this method declaration has none; \
                 put the attribute on the implementations of the method instead",
            )),
            _ => Err(not_a_fn(item)),
        },
        _ => Err(not_a_fn(item)),
    }
}

fn not_a_fn(item: TokenStream) -> syn::Error {
    syn::Error::new_spanned(
        item_head(item),
        "`#[cache_scope]` can only be used on functions and methods; for a block of code, \
         use `cache_scope!(name, { ... })`",
    )
}

/// The head of an item for an error span (`pub struct Foo`, `impl`, `mod m`, `const X`): its
/// tokens after the attributes, up to the first group, `<`, `:`, `=` or `;`.
fn item_head(item: TokenStream) -> TokenStream {
    let mut head = TokenStream::new();
    let mut tokens = item.clone().into_iter().peekable();
    while let Some(token) = tokens.next() {
        match &token {
            // An attribute: `#` and its bracketed group.
            TokenTree::Punct(p) if p.as_char() == '#' && head.is_empty() => {
                tokens.next();
            }
            // `pub(crate)` and the like.
            TokenTree::Ident(i) if i == "pub" => {
                head.extend([token]);
                if let Some(TokenTree::Group(g)) = tokens.peek()
                    && g.delimiter() == Delimiter::Parenthesis
                {
                    head.extend(tokens.next());
                }
            }
            TokenTree::Group(_) => break,
            TokenTree::Punct(p) if matches!(p.as_char(), '<' | ':' | '=' | ';') => break,
            _ => head.extend([token]),
        }
    }
    if head.is_empty() {
        // Nothing recognisable: underline the whole item.
        return item;
    }
    head
}
