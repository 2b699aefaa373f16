@echo off
rem kb-rag installer for Windows: double-click this file, or run it from a command prompt with the options
rem of scripts\install.ps1, for example:  install.cmd -DryRun   or   install.cmd -Profile web -NoModels -Yes
rem It runs scripts\install.ps1 with Windows PowerShell and passes its exit status on (0 installed,
rem 1 a Python step failed, 2 usage error). Without arguments (a double-click) the window stays open at the end.
setlocal
powershell.exe -NoProfile -ExecutionPolicy Bypass -File "%~dp0scripts\install.ps1" %*
set "KB_RAG_INSTALL_STATUS=%ERRORLEVEL%"
if "%~1"=="" pause
exit /b %KB_RAG_INSTALL_STATUS%
