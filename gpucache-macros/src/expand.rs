//! Code generation. The generated code names only `::gpucache::__private` and a guard variable
//! that the user's code cannot see; everything else is the user's tokens, with their spans.

use proc_macro2::{Ident, Span, TokenStream, TokenTree};
use quote::{ToTokens, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Expr, ItemFn, LitStr, ReturnType, Signature, Stmt, parse_quote};

use crate::attr::{BlockArgs, ScopeName};

/// `let <guard> = ::gpucache::__private::enter("name");`. The guard variable has a mixed-site
/// span, which hides it from the user's code: a user variable of the same name neither shadows
/// it nor is shadowed by it.
fn enter(name: &LitStr) -> Stmt {
    let guard = Ident::new("__gpucache_scope", Span::mixed_site());
    parse_quote! {
        let #guard = ::gpucache::__private::enter(#name);
    }
}

/// `#[cache_scope(name)]` on `func`: the signature, attributes (outer and inner) and the body's
/// braces and statements stay the user's, so errors in the body point at the user's code.
///
/// * A sync fn gets the guard as its first statement, so every way out of the body (the tail,
///   `return`, `?`, a panic) exits the scope, after the body's locals are dropped.
/// * An `async fn` keeps its signature (so its lifetimes and `Send`-ness are inferred as
///   before) and its body becomes `instrument(name, async move { body }).await`: the scope is
///   entered around each poll of the body's future, never held across an `.await`.
pub(crate) fn attribute(name: &ScopeName, mut func: ItemFn) -> TokenStream {
    let name = name.lit();
    if func.sig.asyncness.is_some() {
        let stmts = std::mem::take(&mut func.block.stmts);
        let typed_return = typed_return(&func.sig);
        let body = quote! {
            ::gpucache::__private::instrument(#name, async move { #typed_return #(#stmts)* }).await
        };
        func.block
            .stmts
            .push(Stmt::Expr(Expr::Verbatim(body), None));
    } else {
        func.block.stmts.insert(0, enter(&name));
    }
    func.into_token_stream()
}

/// A `return` of the `async fn`'s declared type that is never taken, put first in the async
/// block. Rust infers an async block's output type from its body, so without it a type error in
/// the body would surface at the `.await` of the block, which rustc points at the attribute;
/// with it, the output type is known before the body is checked, and the error points at the
/// user's expression (with a note at the declared return type), and `?` converts errors into
/// the declared type. A return type with an `impl Trait` in it cannot be written as a `let`
/// type, and gets none.
fn typed_return(sig: &Signature) -> Option<TokenStream> {
    let (ty, at) = match &sig.output {
        ReturnType::Default => (quote!(()), sig.ident.span()),
        ReturnType::Type(_, ty) if mentions_impl(ty.to_token_stream()) => return None,
        ReturnType::Type(_, ty) => (ty.to_token_stream(), ty.span()),
    };
    // Hidden from the user's code like the guard, but located at the return type for rustc's
    // "return type inferred to be ... here".
    let span = Span::mixed_site().located_at(at);
    let value = Ident::new("__gpucache_return", span);
    let ret = quote_spanned!(span=> return);
    Some(quote! {
        #[allow(
            unreachable_code,
            clippy::diverging_sub_expression,
            clippy::empty_loop,
            clippy::let_unit_value,
            clippy::needless_return
        )]
        if false {
            let #value: #ty = loop {};
            #ret #value;
        }
    })
}

/// Whether `tokens` contain the keyword `impl`, at any depth.
fn mentions_impl(tokens: TokenStream) -> bool {
    tokens.into_iter().any(|token| match token {
        TokenTree::Ident(ident) => ident == "impl",
        TokenTree::Group(group) => mentions_impl(group.stream()),
        _ => false,
    })
}

/// `cache_scope!(name, body)`: a plain block holding the guard, so `return`, `?`,
/// `break`/`continue` and `.await` in the body act as in any block. A `{ ... }` body gets the
/// guard as its first statement (its braces stay the user's, and no needless nested block is
/// made); any other expression becomes the tail of a new block. An `async` block body is
/// instrumented instead (a guard would only cover the creation of the future).
pub(crate) fn block(args: BlockArgs) -> TokenStream {
    let BlockArgs { name, body } = args;
    let name = name.lit();
    match body {
        Expr::Async(_) => quote! { ::gpucache::__private::instrument(#name, #body) },
        Expr::Block(mut block) => {
            block.block.stmts.insert(0, enter(&name));
            block.into_token_stream()
        }
        body => {
            let enter = enter(&name);
            quote! { { #enter #body } }
        }
    }
}
