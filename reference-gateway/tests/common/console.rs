//! The console as a browser without JavaScript sees it: one session's cookie, forms, the CSRF
//! token in them.

/// A browser without JavaScript: one cookie jar of one session, redirects not followed.
pub struct Session {
    pub http: reqwest::Client,
    pub base: String,
    pub cookie: Option<String>,
}

impl Session {
    pub fn new(base: &str) -> Self {
        Session {
            http: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap(),
            base: base.to_owned(),
            cookie: None,
        }
    }

    pub async fn get(&self, path: &str) -> (u16, String, reqwest::header::HeaderMap) {
        let mut req = self.http.get(format!("{}{path}", self.base));
        if let Some(c) = &self.cookie {
            req = req.header("cookie", c);
        }
        let r = req.send().await.unwrap();
        let (status, headers) = (r.status().as_u16(), r.headers().clone());
        (status, r.text().await.unwrap(), headers)
    }

    pub async fn post(
        &self,
        path: &str,
        form: &[(&str, &str)],
    ) -> (u16, String, reqwest::header::HeaderMap) {
        let mut req = self.http.post(format!("{}{path}", self.base)).form(form);
        if let Some(c) = &self.cookie {
            req = req.header("cookie", c);
        }
        let r = req.send().await.unwrap();
        let (status, headers) = (r.status().as_u16(), r.headers().clone());
        (status, r.text().await.unwrap(), headers)
    }

    /// `POST /console/keys/limits` with `rpm` and TPM 1200; the status.
    pub async fn set_limits(&self, key_hash: &str, rpm: &str, csrf: &str) -> u16 {
        let form = [
            ("key_hash", key_hash),
            ("rpm", rpm),
            ("tpm", "1200"),
            ("csrf", csrf),
        ];
        self.post("/console/keys/limits", &form).await.0
    }

    /// Signs in with a password; asserts the cookie's attributes.
    pub async fn sign_in(&mut self, email: &str, password: &str) {
        let (status, body, headers) = self
            .post(
                "/console/signin",
                &[("email", email), ("password", password)],
            )
            .await;
        assert_eq!(status, 303, "{body}");
        self.take_cookie(&headers);
    }

    pub fn take_cookie(&mut self, headers: &reqwest::header::HeaderMap) {
        let set = headers["set-cookie"].to_str().unwrap().to_owned();
        for attr in ["HttpOnly", "SameSite=Strict", "Path=/console"] {
            assert!(set.contains(attr), "{set}");
        }
        let pair = set.split(';').next().unwrap().to_owned();
        assert!(
            pair.starts_with("spine_console=") && pair.len() == 14 + 64,
            "{pair}"
        );
        self.cookie = Some(pair);
    }
}

/// The value of the first form field named `name` in `html`.
pub fn value_of(html: &str, name: &str) -> Option<String> {
    let prefix = format!("name=\"{name}\" value=\"");
    let at = html.find(&prefix)? + prefix.len();
    Some(html[at..].split('"').next()?.to_owned()).filter(|v| !v.is_empty())
}

pub fn csrf_in(html: &str) -> Option<String> {
    value_of(html, "csrf")
}
